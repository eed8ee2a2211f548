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
import statistics

import case_run


def one(release: str, patched: bool, count: int) -> dict:
    return case_run.run(release, "hybrid-mp", patched=patched, count=count)


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
