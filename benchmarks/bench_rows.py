#!/usr/bin/env python3
"""What each of issue 54's rows costs in throughput: the same run with every row on,
and with the row (or rows) turned off (``VLLM_HSFIX_DISABLED_PATCHES``), alternating so
drift hits both alike. Throughput: prompt tokens per second of the generate call
(waiting for the files included). The run without the row writes wrong files where its
release has the bug; only its time is compared. Run from the repository root:

    python3 benchmarks/bench_rows.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import case_run

# (release, case, its settings over the case's, rows compared)
SETS = (
    # 16 prompts sharing a 140-token prefix, prefix caching on: prefix-cache hits
    (
        "0.22.0",
        "dense-mp",
        {"prompts": "shared", "engine": (("enable_prefix_caching", True), ("max_num_seqs", 8))},
        "slots-from-blocks",
    ),
    # the same prompts on 0.25.0 (its hybrid needs chunked prefill with prefix caching)
    (
        "0.25.0",
        "dense-mp",
        {"prompts": "shared", "engine": (("enable_prefix_caching", True), ("max_num_seqs", 8))},
        "drafter-skip-guard,next-token-last-valid",
    ),
)


def one(release: str, case: str, over: dict, off: str) -> dict:
    env = {"VLLM_HSFIX_DISABLED_PATCHES": off} if off else {}
    return case_run.run(release, case, over=over, env=env)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--release", help="only the sets of this release")
    args = ap.parse_args()
    worst = float("inf")
    for release, case, over, rows in SETS:
        if args.release and release != args.release:
            continue
        runs: dict[str, list[dict]] = {"on": [], "off": []}
        for i in range(args.repeats):
            for label, off in (("on", ""), ("off", rows)):
                r = one(release, case, over, off)
                runs[label].append(r)
                right, total = r["rows"]
                print(f"{release} {case} {rows} {label:>3} run {i + 1}: {r['tok_s']:8.1f} "
                      f"tok/s, rows right {right}/{total}", flush=True)  # fmt: skip
        on, off = (statistics.median(x["tok_s"] for x in runs[k]) for k in ("on", "off"))
        worst = min(worst, on / off)
        print(f"{release} {rows}: median {on:.1f} tok/s with, {off:.1f} without: {on / off:.3f}\n")
        if not all(r["rows"][0] == r["rows"][1] for r in runs["on"]):
            print("FAILED: a run with every row on wrote a wrong row")
            return 1
    print(f"worst ratio with/without: {worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
