#!/usr/bin/env python3
"""One engine run of a demo case for the benchmarks: ``run(release, ...)`` starts this
file in the release's environment, which runs ``hsfix_demo.e2e.run_case`` and prints
``BENCH {json}`` (``case_run.py ARGS_JSON``: case, settings over it, patched, count,
extra environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run(
    release: str,
    case: str,
    *,
    over: dict[str, Any] | None = None,
    patched: bool = True,
    count: int | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The run's rates and row counts (exits naming the failure when it fails)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import vllm_env

    ((_, py, overlay),) = vllm_env.ensure([release])
    child_env = vllm_env.env_for(overlay)
    child_env["VLLM_HSFIX_CACHE"] = str(vllm_env.CACHE)
    child_env["PYTHONPATH"] = os.pathsep.join([child_env["PYTHONPATH"], str(ROOT)])
    args = {"case": case, "over": over or {}, "patched": patched, "count": count,
            "env": env or {}, "models": str(vllm_env.CACHE / "models")}  # fmt: skip
    cmd = [str(py), __file__, json.dumps(args)]
    out = subprocess.run(cmd, env=child_env, capture_output=True, text=True)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("BENCH ")), None)
    if line is None:
        raise SystemExit(f"run failed:\n{out.stderr[-2000:]}")
    data = json.loads(line[6:])
    if not data["ok"]:
        raise SystemExit(f"run failed: {data['error']}")
    r = data["run"]
    return {"tok_s": r["prompt_tokens"] / r["generate_s"], "correct": data["correct"],
            "rows": data["rows"], "generate_s": r["generate_s"],
            "startup_s": r["startup_s"]}  # fmt: skip


def main() -> None:
    import dataclasses
    import tempfile

    from hsfix_demo import e2e

    a = json.loads(sys.argv[1])
    over = {k: tuple(map(tuple, v)) if k == "engine" else v for k, v in a["over"].items()}
    case = dataclasses.replace(e2e.CASES[a["case"]], **over)
    r = e2e.run_case(case, patched=a["patched"], workdir=Path(tempfile.mkdtemp()),
                     models=Path(a["models"]), extra_env=a["env"], count=a["count"])  # fmt: skip
    rows = [r.rows_correct, r.rows]
    result = {"ok": r.ok_run, "correct": r.rows_correct == r.rows, "rows": rows,
              "run": r.run, "error": r.error}  # fmt: skip
    print("BENCH " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
