#!/usr/bin/env python3
"""What vllm-hsfix adds at start-up, each figure against a baseline measured in the same run.

vLLM loads its general plugins in every process it starts, and the sitecustomize
bootstrap imports the package in every Python process of an image, so both costs are
paid many times over. Measured here:

(a) ``import vllm_hsfix`` against a bare interpreter: wall time of fresh processes
    (interleaved, median) and ``-X importtime``'s cumulative figure for the package.
    Twice: in this interpreter as it starts (``site``), and with ``-S`` plus
    ``import os`` in both the baseline and the measured process (``no-site``): that is
    what an interpreter whose ``site`` loads only ``os`` has (a wheel install), where a
    development venv's editable-install finder has already loaded ``re``, ``pathlib``
    and more, and would hide what the package itself pulls in.
(b) vLLM's ``load_general_plugins()`` with ``VLLM_PLUGINS=vllm_hsfix`` and with no
    plugin allowed (vLLM already imported in both, as in vLLM's processes; the entry
    points are scanned in both), interleaved, median; and the modules only the run
    with the plugin has loaded. Other plugins (vLLM 0.24's own LoRA resolvers take
    ~100 ms) are left out of both: they would only add their own noise to the delta.
(c) the in-situ scatter check a worker runs once when it registers its KV caches.
(d) ``vllm_hsfix_dist.pth`` (``cpu-dist-name``), run by ``site`` in every Python process
    of the environment: ``-X importtime`` of ``_vllm_hsfix_dist`` and the wall delta.

Bytecode: an installed wheel has its ``.pyc`` files; a checkout run with
``PYTHONDONTWRITEBYTECODE`` (as some CI images set) would compile the package's source
in every process and measure the compiler. So the child processes write and read
bytecode under a cache of their own (``PYTHONPYCACHEPREFIX``, default
``$VLLM_HSFIX_CACHE/bench-pycache``; nothing is written into the source tree), and one
unmeasured warm-up run of each variant fills it.

Run inside a vLLM environment:
    python3 scripts/vllm_env.py exec 0.24.0 -- python benchmarks/bench_startup.py
Environment: BENCH_RUNS (fresh processes per import variant, default 21; the
plugin variants get max(7, BENCH_RUNS // 2)), BENCH_PYCACHE (the bytecode cache),
BENCH_SKIP_CHECK=1 (leave out (c), which needs torch).
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path


def machine() -> str:
    """The CPU model (what the figures depend on) and the interpreter."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def child_env(**extra: str) -> dict[str, str]:
    """The environment of every measured process: no VLLM_HSFIX_* switch, bytecode on
    (in a cache of our own), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_HSFIX_")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    cache = Path(os.environ.get("VLLM_HSFIX_CACHE", Path.home() / ".cache" / "vllm-hsfix"))
    env["PYTHONPYCACHEPREFIX"] = os.environ.get("BENCH_PYCACHE", str(cache / "bench-pycache"))
    env.update(extra)
    return env


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, check=False
    )
    if out.returncode != 0:
        raise SystemExit(f"{args} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return out


def wall(args: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    run(args, env)
    return time.perf_counter() - t0


def importtime_us(args: list[str], env: dict[str, str]) -> int:
    """``-X importtime``'s cumulative microseconds for the top-level ``vllm_hsfix``."""
    err = run(["-X", "importtime", *args], env).stderr
    total = 0
    for line in err.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)$", line)
        if m and m.group(4) == "vllm_hsfix":
            total = int(m.group(2))
    if not total:
        raise SystemExit(f"no -X importtime line for vllm_hsfix in:\n{err[-2000:]}")
    return total


def med_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def import_cost(n: int, env: dict[str, str]) -> dict[str, float]:
    """Per variant, the median ``-X importtime`` cumulative figure, in ms."""
    variants = {
        "site": (["-c", "pass"], ["-c", "import vllm_hsfix"]),
        "no-site": (["-S", "-c", "import os"], ["-S", "-c", "import os; import vllm_hsfix"]),
    }
    print(f"(a) import vllm_hsfix, {n} fresh processes per variant, interleaved (median):")
    cumulative = {}
    for name, (bare_args, pkg_args) in variants.items():
        wall(bare_args, env)  # warm-up: fills the bytecode cache
        wall(pkg_args, env)
        bare, pkg, it = [], [], []
        for _ in range(n):  # interleaved, so drift and the neighbours' load hit both alike
            bare.append(wall(bare_args, env))
            pkg.append(wall(pkg_args, env))
            it.append(importtime_us(pkg_args, env))
        b, p = med_ms(bare), med_ms(pkg)
        print(
            f"    [{name:7}] bare interpreter {b:7.1f} ms | with import vllm_hsfix {p:7.1f} ms"
            f" | delta {p - b:+6.1f} ms, ratio {p / b:.3f}"
        )
        print(
            f"    [{name:7}] -X importtime vllm_hsfix cumulative: median "
            f"{statistics.median(it):.0f} us (min {min(it)}, max {max(it)})"
        )
        cumulative[name] = statistics.median(it) / 1e3
    new = run(
        [
            "-S",
            "-c",
            "import os, sys, json; before = set(sys.modules); import vllm_hsfix; "
            "print(json.dumps(sorted(set(sys.modules) - before)))",
        ],
        env,
    ).stdout
    print(f"    modules import vllm_hsfix adds (no-site): {' '.join(json.loads(new))}")
    return cumulative


def pth_cost(n: int, env: dict[str, str]) -> float:
    """(d) ``vllm_hsfix_dist.pth`` (``cpu-dist-name``): every Python process of the
    environment imports ``_vllm_hsfix_dist`` at start-up. Its ``-X importtime`` figure in
    a normal start (the .pth itself), and the wall time of ``-S`` processes importing it
    against ones that do not, interleaved (median)."""
    err = run(["-X", "importtime", "-c", "pass"], env).stderr
    if "_vllm_hsfix_dist" not in err:
        print("(d) vllm_hsfix_dist.pth: not installed in this environment (skipped)")
        return float("nan")
    bare_args, pth_args = ["-S", "-c", "import os"], ["-S", "-c", "import os, _vllm_hsfix_dist"]
    wall(bare_args, env)
    wall(pth_args, env)
    bare, pth, it = [], [], []
    for _ in range(n):
        bare.append(wall(bare_args, env))
        pth.append(wall(pth_args, env))
        lines = run(["-X", "importtime", "-c", "pass"], env).stderr.splitlines()
        it += [int(ln.split("|")[1]) for ln in lines if ln.rstrip().endswith("_vllm_hsfix_dist")]
    b, p = med_ms(bare), med_ms(pth)
    print(f"(d) vllm_hsfix_dist.pth (cpu-dist-name), {n} fresh processes per variant (median):")
    print(
        f"    -X importtime _vllm_hsfix_dist at start-up: {statistics.median(it):.0f} us; "
        f"-S + import os {b:.1f} ms | + _vllm_hsfix_dist {p:.1f} ms | delta {p - b:+.2f} ms, "
        f"ratio {p / b:.3f}"
    )
    return statistics.median(it) / 1e3


PLUGINS = """
import json, sys, time
import vllm, vllm.plugins as p
before = set(sys.modules)
t0 = time.perf_counter()
p.load_general_plugins()
dt = time.perf_counter() - t0
print(json.dumps([dt, sorted(set(sys.modules) - before)]))
"""


def plugin_cost(m: int) -> float:
    """The median delta the plugin adds to ``load_general_plugins()``, in ms."""
    from importlib.metadata import entry_points

    names = sorted({ep.name for ep in entry_points(group="vllm.general_plugins")})
    if "vllm_hsfix" not in names:
        raise SystemExit(f"vllm_hsfix is not a registered vllm.general_plugins entry: {names}")
    with_env = child_env(VLLM_PLUGINS="vllm_hsfix")
    without_env = child_env(VLLM_PLUGINS="no_such_plugin")

    def once(env: dict[str, str]) -> tuple[float, list[str]]:
        dt, new = json.loads(run(["-c", PLUGINS], env).stdout.strip().splitlines()[-1])
        return float(dt), new

    once(without_env)  # warm-up: vLLM's own bytecode lands in the cache here (slow once)
    once(with_env)
    a, b = [], []
    base: list[str] = []
    loaded: list[str] = []
    for _ in range(m):
        dt, base = once(without_env)
        a.append(dt)
        dt, loaded = once(with_env)
        b.append(dt)
    ma, mb = med_ms(a), med_ms(b)
    print(
        f"(b) load_general_plugins(), vLLM imported first, {m} fresh processes each, "
        f"interleaved (median); plugins installed: {names}"
    )
    print(f"    no plugin allowed   {ma:7.1f} ms  (min {min(a) * 1e3:.1f})")
    print(
        f"    vllm_hsfix only     {mb:7.1f} ms  (min {min(b) * 1e3:.1f})  "
        f"delta {mb - ma:+6.1f} ms (by minima {(min(b) - min(a)) * 1e3:+.1f}), "
        f"ratio {mb / ma:.2f}"
    )
    extra = sorted(set(loaded) - set(base))
    ours = [x for x in extra if x.startswith("vllm_hsfix")]
    theirs = [x for x in extra if not x.startswith("vllm_hsfix")]
    print(f"    modules the plugin leaves loaded: {len(ours)} of vllm_hsfix: {' '.join(ours)}")
    print(f"      and {len(theirs)} others: {' '.join(theirs) or '-'}")
    return mb - ma


def check_cost() -> None:
    import torch

    from vllm_hsfix.patches.scatter_clamp import checks as scatter_checks
    from vllm_hsfix.patches.scatter_clamp.fix import scatter_clamped

    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        case = scatter_checks.scratch_case(
            device="cpu",
            dtype=torch.bfloat16,
            num_blocks=3,
            block_size=8,
            heads=3,
            head=2048,
            padding=2,
        )
        problems = scatter_checks.check_scatter(scatter_clamped, case)
        times.append(time.perf_counter() - t0)
        assert not problems
    print(
        "(c) in-situ check (3 aux x 2048 hidden, bf16, CPU), 50 runs: "
        f"median {statistics.median(times) * 1e3:.2f} ms, max {max(times) * 1e3:.2f} ms"
    )


def main() -> None:
    n = max(5, int(os.environ.get("BENCH_RUNS", "21")))
    from importlib.util import find_spec

    spec = find_spec("vllm_hsfix")  # found, not imported: this process stays unpatched
    print(f"machine: {machine()}")
    print(f"vllm_hsfix from {spec.origin if spec else None}")
    cumulative = import_cost(n, child_env())
    delta = plugin_cost(max(7, n // 2))
    pth = pth_cost(n, child_env())
    if os.environ.get("BENCH_SKIP_CHECK") != "1":
        check_cost()
    # The start-up budgets (the cost in every process), next to what was measured.
    print(
        f"summary: import vllm_hsfix {cumulative['no-site']:.2f} ms cumulative without site, "
        f"{cumulative['site']:.2f} ms with (target <= 1 ms); plugin {delta:+.1f} ms per vLLM "
        f"process (target <= 10 ms); .pth {pth:.2f} ms in every Python process"
    )


if __name__ == "__main__":
    main()
