#!/usr/bin/env python3
"""What vllm-hsfix adds at start-up, measured against a baseline in the same run.

(a) ``import vllm_hsfix`` against a bare interpreter (wall time of fresh processes,
    and ``-X importtime``'s cumulative figure for the package);
(b) vLLM's ``load_general_plugins()`` with the vllm_hsfix plugin and with it filtered
    out by ``VLLM_PLUGINS`` (vLLM already imported in both, as in vLLM's processes);
(c) the in-situ scatter check a worker runs once when it registers its KV caches.

Run inside a vLLM environment:
    python3 scripts/vllm_env.py exec 0.24.0 -- python benchmarks/bench_startup.py
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time


def fresh(code: str, env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - t0


def importtime_us() -> int:
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import vllm_hsfix"],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    total = 0
    for line in out.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if m and m.group(4) == "vllm_hsfix":
            total = int(m.group(2))
    return total


def timed_plugins(env: dict[str, str]) -> float:
    code = (
        "import time, vllm, vllm.plugins as p\n"
        "t0 = time.perf_counter(); p.load_general_plugins(); "
        "print(time.perf_counter() - t0)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    ).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    n = int(os.environ.get("BENCH_RUNS", "15"))
    bare, imp = [], []
    for _ in range(n):  # interleaved, so drift hits both alike
        bare.append(fresh("pass"))
        imp.append(fresh("import vllm_hsfix"))
    it = sorted(importtime_us() for _ in range(n))
    print(f"(a) import cost, {n} fresh processes each (median):")
    print(f"    bare interpreter          {statistics.median(bare) * 1e3:8.1f} ms")
    print(
        f"    import vllm_hsfix         {statistics.median(imp) * 1e3:8.1f} ms   "
        f"(+{(statistics.median(imp) - statistics.median(bare)) * 1e3:.1f} ms, "
        f"ratio {statistics.median(imp) / statistics.median(bare):.3f})"
    )
    print(f"    -X importtime vllm_hsfix  {statistics.median(it) / 1e3:8.2f} ms cumulative")

    from importlib.metadata import entry_points

    names = sorted({ep.name for ep in entry_points(group="vllm.general_plugins")})
    others = [n for n in names if n != "vllm_hsfix"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_HSFIX_")}
    # Same plugins loaded in both (vLLM ships its own), only vllm_hsfix differs.
    with_pkg = dict(base, VLLM_PLUGINS=",".join(names))
    without = dict(base, VLLM_PLUGINS=",".join(others) or "no_such_plugin")
    m = max(3, n // 3)
    a, b = [], []
    for _ in range(m):
        a.append(timed_plugins(without))
        b.append(timed_plugins(with_pkg))
    ma, mb = statistics.median(a), statistics.median(b)
    print(
        f"(b) load_general_plugins(), {m} fresh processes each (median); plugins installed: {names}"
    )
    print(f"    without vllm_hsfix        {ma * 1e3:8.1f} ms")
    print(f"    with vllm_hsfix           {mb * 1e3:8.1f} ms   (+{(mb - ma) * 1e3:.1f} ms)")

    import torch

    from vllm_hsfix import checks
    from vllm_hsfix.patches.scatter import scatter_clamped

    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        case = checks.scratch_case(
            device="cpu",
            dtype=torch.bfloat16,
            num_blocks=3,
            block_size=8,
            heads=3,
            head=2048,
            padding=2,
        )
        problems = checks.check_scatter(scatter_clamped, case)
        times.append(time.perf_counter() - t0)
        assert not problems
    print(
        "(c) in-situ check (3 aux x 2048 hidden, bf16, CPU), 50 runs: "
        f"median {statistics.median(times) * 1e3:.2f} ms, max {max(times) * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
