#!/usr/bin/env python3
"""Hidden-states extraction throughput: patched vLLM 0.24.0 against unpatched 0.25.0.

Same tiny hybrid model, same prompts, worker in its own process, CPU; runs alternate
between the two releases so drift hits both alike. Throughput is prompt tokens per
second of the generate call (including waiting for the files to be written).
Target: ratio >= 0.98. Run from the repository root with any Python 3:

    python3 benchmarks/bench_e2e.py [--repeats 2] [--prompts 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import vllm_env  # noqa: E402

ONE_RUN = """
import json, sys, tempfile
from pathlib import Path
from hsfix_demo import e2e
r = e2e.run_case(e2e.CASES["hybrid-mp"], patched={patched}, workdir=Path(tempfile.mkdtemp()),
                 models=Path({models!r}), count={count})
print("BENCH " + json.dumps({{"ok": r.ok_run, "correct": r.rows_correct == r.rows,
      "run": r.run, "error": r.error}}))
"""


def one(release: str, patched: bool, count: int) -> dict:
    ((_, py, overlay),) = vllm_env.ensure([release])
    env = vllm_env.env_for(overlay)
    env["VLLM_HSFIX_CACHE"] = str(vllm_env.CACHE)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(ROOT)])  # hsfix_demo
    code = ONE_RUN.format(patched=patched, models=str(vllm_env.CACHE / "models"), count=count)
    out = subprocess.run([str(py), "-c", code], env=env, capture_output=True, text=True)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("BENCH ")), None)
    if line is None:
        raise SystemExit(f"run failed:\n{out.stderr[-2000:]}")
    data = json.loads(line[6:])
    if not data["ok"]:
        raise SystemExit(f"run failed: {data['error']}")
    run = data["run"]
    return {
        "tok_s": run["prompt_tokens"] / run["generate_s"],
        "correct": data["correct"],
        "generate_s": run["generate_s"],
        "startup_s": run["startup_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"0.24.0 + vllm-hsfix": [], "0.25.0 (upstream fix)": []}
    for i in range(args.repeats):
        for label, release, patched in (
            ("0.24.0 + vllm-hsfix", "0.24.0", True),
            ("0.25.0 (upstream fix)", "0.25.0", False),
        ):
            r = one(release, patched, args.prompts)
            runs[label].append(r)
            print(
                f"run {i + 1} {label:<22} {r['tok_s']:8.1f} tok/s  generate {r['generate_s']:.1f} s"
                f"  start-up {r['startup_s']:.1f} s  rows correct: {r['correct']}",
                flush=True,
            )
    med = {k: statistics.median(x["tok_s"] for x in v) for k, v in runs.items()}
    a, b = med["0.24.0 + vllm-hsfix"], med["0.25.0 (upstream fix)"]
    print(f"\nmedian tok/s: patched 0.24.0 {a:.1f}, unpatched 0.25.0 {b:.1f}, ratio {a / b:.3f}")


if __name__ == "__main__":
    main()
