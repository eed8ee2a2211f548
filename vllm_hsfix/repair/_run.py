"""The repair's vLLM process: ``python -m vllm_hsfix.repair._run JOB.json``.

Started by :mod:`.command` with ``VLLM_HSFIX_STATUS_DIR`` set, so every vLLM process
of the run (this one, the engine core, the workers) reports vllm-hsfix's status; a
process of its own because the status directory must be known before vllm-hsfix
activates, and because the check must run where vLLM runs. It starts the engine,
runs :func:`.guard.in_engine` and prints the verdict before the first request, then
one line per regenerated file, as each batch's files are written:

    HSFIX_REPAIR_GUARD ["problem", ...]          (empty: go on; else exit 3, no request)
    HSFIX_REPAIR_FILE [index, "/scratch/...safetensors" or null]
    HSFIX_REPAIR_DONE []                           (every prompt answered; what is left
                                                   is vLLM's own shutdown)
    HSFIX_REPAIR_BADARG ["key", "why"]           (an --engine-arg vLLM has no such
                                                   argument for, exit 2; or one whose
                                                   value vLLM rejected, then the error)

It stops between batches when its parent is gone (a killed repair leaves no engine),
and exits (5, the cause in the log) when one of vLLM's processes dies under it and
vLLM itself would wait forever (:mod:`.watch`).
"""

from __future__ import annotations

import json
import os
import sys

from .engine import EndpointEngine, EngineSpec, LocalEngine
from .guard import in_engine
from .watch import EngineWatch

GUARD, FILE, BADARG = "HSFIX_REPAIR_GUARD ", "HSFIX_REPAIR_FILE ", "HSFIX_REPAIR_BADARG "
DONE = "HSFIX_REPAIR_DONE "
# Exceptions of vLLM's argument and config checks: a user's value among them is named.
REJECTED = ("ValueError", "TypeError", "ValidationError", "AssertionError")


def unknown_args(user: dict[str, object]) -> list[tuple[str, str]]:
    """The user's engine arguments that vLLM's ``LLM`` / ``EngineArgs`` do not take."""
    import dataclasses
    import difflib
    import inspect

    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    known |= set(inspect.signature(LLM.__init__).parameters) - {"self", "kwargs"}
    out = []
    for key in user:
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            out.append((key, f"vLLM {_vllm_version()} has no engine argument {key!r}{hint}"))
    return out


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "?"))


def rejected(exc: BaseException, user: dict[str, object]) -> tuple[str, str] | None:
    """(key, vLLM's message) when ``exc`` is vLLM rejecting one of the user's values."""
    import re

    text = str(exc)
    if not any(t in type(exc).__name__ for t in REJECTED):
        return None
    for key in user:
        if re.search(rf"\b{re.escape(key)}\b", text):
            lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
            return key, f"{type(exc).__name__}: " + " / ".join(lines[:4])
    return None


def main(argv: list[str]) -> int:
    with open(argv[0], encoding="utf-8") as f:
        job = json.load(f)
    parent = os.getppid()
    if job.get("endpoint"):
        engine: LocalEngine | EndpointEngine = EndpointEngine(job["endpoint"], job.get("served"))
    else:
        spec = EngineSpec(**{**job["spec"], "aux_layers": tuple(job["spec"]["aux_layers"])})
        engine = LocalEngine(spec, job["scratch"])
        bad = unknown_args(job.get("user_args") or {})
        for key, why in bad:
            print(BADARG + json.dumps([key, why]), flush=True)
        if bad:
            return 2
    try:
        engine.start()
    except Exception as exc:
        found = None if job.get("endpoint") else rejected(exc, job.get("user_args") or {})
        if found:
            print(BADARG + json.dumps(list(found)), flush=True)
        raise
    problems = [] if job.get("endpoint") else in_engine(job["status_dir"], job["needed"])
    print(GUARD + json.dumps(problems), flush=True)
    if problems:
        return 3
    watch = EngineWatch()  # a vLLM process killed under us must not leave us waiting
    if not job.get("endpoint"):
        watch.start()
    try:
        if not _generate_all(engine, job["prompts"], job["batch_size"], parent):
            return 4  # the repair was killed: stop, leave nothing running
    except BaseException:
        watch.tell()  # vLLM raised because one of its processes died: which, and how
        raise
    finally:
        watch.stop()
    print(DONE + "[]", flush=True)
    engine.close()
    return 0


def _generate_all(
    engine: LocalEngine | EndpointEngine, prompts: list[list[int]], size: int, parent: int
) -> bool:
    """Every prompt in batches of ``size``, a FILE line per file as each batch is
    written; False when the repair (``parent``) is gone between batches."""
    for start in range(0, len(prompts), size):
        if os.getppid() != parent:
            return False
        paths = engine.generate(prompts[start : start + size])
        for k, path in enumerate(paths):
            print(FILE + json.dumps([start + k, path]), flush=True)
    return True


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
