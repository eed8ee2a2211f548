"""The repair's vLLM process: ``python -m vllm_hsfix.repair._run JOB.json``.

Started by :mod:`.command` with ``VLLM_HSFIX_STATUS_DIR`` set, so every vLLM process
of the run (this one, the engine core, the workers) reports vllm-hsfix's status; a
process of its own because the status directory must be known before vllm-hsfix
activates, and because the check must run where vLLM runs. It starts the engine,
runs :func:`.guard.in_engine` and prints the verdict before the first request, then
one line per regenerated file, as each batch's files are written:

    HSFIX_REPAIR_GUARD ["problem", ...]          (empty: go on; else exit 3, no request)
    HSFIX_REPAIR_FILE [index, "/scratch/...safetensors" or null]

It stops between batches when its parent is gone (a killed repair leaves no engine).
"""

from __future__ import annotations

import json
import os
import sys

from .engine import EndpointEngine, EngineSpec, LocalEngine
from .guard import in_engine

GUARD, FILE = "HSFIX_REPAIR_GUARD ", "HSFIX_REPAIR_FILE "


def main(argv: list[str]) -> int:
    with open(argv[0], encoding="utf-8") as f:
        job = json.load(f)
    parent = os.getppid()
    if job.get("endpoint"):
        engine: LocalEngine | EndpointEngine = EndpointEngine(job["endpoint"], job.get("served"))
    else:
        spec = EngineSpec(**{**job["spec"], "aux_layers": tuple(job["spec"]["aux_layers"])})
        engine = LocalEngine(spec, job["scratch"])
    engine.start()
    problems = [] if job.get("endpoint") else in_engine(job["status_dir"], job["needed"])
    print(GUARD + json.dumps(problems), flush=True)
    if problems:
        return 3
    prompts: list[list[int]] = job["prompts"]
    size = job["batch_size"]
    for start in range(0, len(prompts), size):
        if os.getppid() != parent:
            return 4  # the repair was killed: stop, leave nothing running
        paths = engine.generate(prompts[start : start + size])
        for k, path in enumerate(paths):
            print(FILE + json.dumps([start + k, path]), flush=True)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
