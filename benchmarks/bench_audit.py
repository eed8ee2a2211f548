#!/usr/bin/env python3
"""How fast is ``vllm-hsfix audit`` next to ``cat`` reading the same bytes from the page cache?

Corpora shaped like speculators' data-generation output (one file per sample, named
``hs_<i>.safetensors``, 4 aux layers, the last one the final layer with the largest
norms; 3 of 4 files start with a shared 24-token template, as chat-templated prompts
do), built once under ``~/.cache/vllm-hsfix/bench-audit`` and reused by later runs:

* ``bf16``: ``hidden_states`` BF16 (vLLM's ``ExampleHiddenStatesConnector``), hidden
  4096, 200-4000 tokens capped so that files are 1-30 MB, about 4 GB in all;
* ``fp8``: ``hidden_states`` float8_e4m3fn plus ``hidden_states_scales`` F32
  ``[tokens, 1, 1]`` (hs-connectors' ``FP8HiddenStatesConnector``), hidden 7168, same
  rules, about 2 GB (past ``vllm_hsfix.audit.decode.MIN_BYTES``: the compiled fp8
  kernel is used, as on real datasets);
* ``small``: the small-file stress corpus, 20,000 files of 16-48 tokens, hidden 256,
  3 aux layers, a ``.lock`` beside each (in 4 sub-folders: the first alone is the
  "quarter" run of the memory check).

For each corpus and repetition, in this order: the corpus is read once (so it is in
the page cache), then timed ``cat FILES > /dev/null`` (batches of 500 files), then the
audit with 1 and 2 worker processes. Each audit runs in a fresh driver process (as
the CLI does, records streamed, full reports not kept); the driver reports its own
peak RSS (VmHWM), so memory can be compared between the quarter and the whole small
corpus. The speeds are printed as ratios to ``cat`` of the same repetition: for the
large corpora GB/s per worker / cat's GB/s (goal >= 0.6), for the small one files/s
with 2 workers / cat's files/s (goal >= 0.25). On a shared machine the wall-clock
ratios follow the load; the CPU columns do not: cat's CPU seconds over the audit's
(driver and workers), the speed a worker that had a core to itself would reach next
to a cat that had one. The compiled fp8 kernel's load (importing numba, once per
process, :mod:`vllm_hsfix.audit.kernel`) is in the seconds and also reported apart,
with the ratio after it. The "scan pace" column leaves out every cost a run pays once
(interpreter, imports, the kernel's load, starting the workers, the dataset pass):
the bytes judged between the results that brought the total to 10% and to 90% of the
corpus, over the time between, per worker, as a ratio to cat: what a dataset of 10^5
files and more sees (speculators' scale). Goals are
reported, never asserted;
the exit status is non-zero only when something could not be measured or a clean
corpus got a verdict other than ok.

    python benchmarks/bench_audit.py                        # everything, 3 repetitions
    python benchmarks/bench_audit.py --corpora bf16 --repeat 5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SPEC_VERSION = 1  # bump when the files' contents change: the cache is rebuilt
MB = 1024 * 1024
TEMPLATE = 24  # shared-prefix tokens
LIMITS = {"min_bytes": 1 * MB, "max_bytes": 30 * MB, "min_tokens": 200, "max_tokens": 4000}
CORPORA = {
    "bf16": {"dtype": "BF16", "hidden": 4096, "n_aux": 4, "gb": 4.0, **LIMITS},
    "fp8": {"dtype": "F8_E4M3", "hidden": 7168, "n_aux": 4, "gb": 2.0, **LIMITS},
    "small": {"dtype": "BF16", "hidden": 256, "n_aux": 3, "files": 20_000, "parts": 4,
              "min_tokens": 16, "max_tokens": 48, "locks": True},
}  # fmt: skip


# ----------------------------------------------------------------- writing the corpora


def layer_scales(n_aux: int) -> np.ndarray:
    """Each aux layer's own scale (real layers have different norms; the last aux
    layer, the final hidden state, the largest)."""
    s = [1.0, 4.0, 16.0][: max(0, n_aux - 1)] + [1.0] * max(0, n_aux - 4) + [32.0]
    return np.array(s[:n_aux], dtype=np.float32)


def fp8_encoder() -> np.ndarray:
    """float16 bit pattern -> the nearest float8_e4m3fn byte (65536-entry table)."""
    from vllm_hsfix.audit.decode import fp8_e4m3fn_table

    t = fp8_e4m3fn_table()
    pos = np.arange(0x7F)  # 0x00..0x7E: the finite non-negative values, increasing
    vals = t[pos].astype(np.float64)
    x = np.abs(np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float64))
    x = np.nan_to_num(np.minimum(x, 448.0))
    i = np.clip(np.searchsorted(vals, x), 1, len(vals) - 1)
    near = np.where(x - vals[i - 1] <= vals[i] - x, i - 1, i).astype(np.uint8)
    sign = (np.arange(65536) >> 15).astype(np.uint8) << 7
    return near | sign


def write_file(path: Path, spec: dict, tokens: int, rng, template, enc) -> int:
    """One file, written a slab of tokens at a time through a memmap."""
    n_aux, hidden, fp8 = spec["n_aux"], spec["hidden"], spec["dtype"] == "F8_E4M3"
    n_hs = tokens * n_aux * hidden * (1 if fp8 else 2)
    entries = [("hidden_states", spec["dtype"], [tokens, n_aux, hidden], n_hs)]
    if fp8:
        entries.append(("hidden_states_scales", "F32", [tokens, 1, 1], 4 * tokens))
    entries.append(("token_ids", "I64", [tokens], 8 * tokens))
    header, off = {}, 0
    for name, dtype, shape, n in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(start + off)
    hs = np.memmap(path, "u1" if fp8 else "<u2", "r+", start, (tokens, n_aux, hidden))
    scales = np.memmap(path, "<f4", "r+", start + n_hs, (tokens,)) if fp8 else None
    k = min(tokens, TEMPLATE) if template is not None else 0
    lsc = layer_scales(n_aux)[None, :, None]
    for t in range(0, tokens, 256):
        e = min(tokens, t + 256)
        block = rng.standard_normal((e - t, n_aux, hidden), dtype=np.float32) * lsc
        if t < k:
            block[: k - t] = template[1][t:k]
        if fp8:
            amax = np.abs(block).max(axis=(1, 2))
            sc = np.maximum(amax / 448.0, 1e-12).astype(np.float32)
            scales[t:e] = sc
            q = (block / sc[:, None, None]).astype(np.float16).view(np.uint16)
            hs[t:e] = enc[q]
        else:
            hs[t:e] = (block.view(np.uint32) >> 16).astype(np.uint16)
    ids = np.memmap(path, "<i8", "r+", start + off - 8 * tokens, (tokens,))
    ids[:] = rng.integers(0, 150_000, size=tokens)
    # Rows are random, not causal: a file without the template gets a first token no
    # other file has, so only files that really share rows share a prefix.
    ids[0] = 200_000 + int(path.stem.rsplit("_", 1)[-1])
    if k:
        ids[:k] = template[0][:k]
    for m in (hs, scales, ids):
        if m is not None:
            m.flush()
    del hs, scales, ids
    return start + off


def build(name: str, spec: dict, cache: Path, seed: int) -> Path:
    """The corpus ``name`` under ``cache`` (reused when already complete)."""
    key = hashlib.sha256(json.dumps([SPEC_VERSION, spec, seed], sort_keys=True).encode())
    root = cache / f"{name}-{key.hexdigest()[:10]}"
    if (root / "spec.json").exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    n_aux, hidden = spec["n_aux"], spec["hidden"]
    rows = rng.standard_normal((TEMPLATE, n_aux, hidden), dtype=np.float32)
    template = (rng.integers(0, 150_000, size=TEMPLATE), rows * layer_scales(n_aux)[None, :, None])
    enc = fp8_encoder() if spec["dtype"] == "F8_E4M3" else None
    per_token = n_aux * hidden * (1 if enc is not None else 2)
    lo = max(spec["min_tokens"], -(-spec.get("min_bytes", 0) // per_token))
    hi = min(spec["max_tokens"], spec.get("max_bytes", 1 << 62) // per_token)
    budget, n_files = int(spec.get("gb", 1e9) * 1e9), spec.get("files", 1 << 62)
    parts = spec.get("parts", 1)
    total = i = 0
    while i < n_files and total < budget:
        sub = root / f"p{i % parts}" if parts > 1 else root
        sub.mkdir(exist_ok=True)
        path = sub / f"hs_{i}.safetensors"
        shared = template if i % 4 else None  # 3 of 4 files start with the template
        total += write_file(path, spec, int(rng.integers(lo, hi + 1)), rng, shared, enc)
        if spec.get("locks"):
            (sub / f"{path.name}.lock").touch()  # the connector leaves these beside
        i += 1
    (root / "spec.json").write_text(json.dumps({"spec": spec, "files": i, "bytes": total}))
    print(f"{name}: wrote {i} files, {total / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s")
    return root


# ----------------------------------------------------------------- measuring


def files_of(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("*.safetensors"))


def cat(files: list[str]) -> tuple[float, float]:
    """``cat`` the files to /dev/null (in batches of 500, under ARG_MAX): seconds, and
    the CPU seconds the cat processes used."""
    import resource

    def kids() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    t0, c0 = time.perf_counter(), kids()
    for i in range(0, len(files), 500):
        subprocess.run(["cat", *files[i : i + 500]], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0, kids() - c0


def child(roots: list[str], workers: str) -> None:
    """One audit in this fresh process (the CLI's way: records streamed, reports not
    kept); prints its seconds and CPU seconds (driver and workers), verdict counts and
    this driver's peak RSS. ``workers``
    ``ray``: on a local Ray cluster of 2 nodes with 1 CPU each."""
    from vllm_hsfix.audit import decode, pipeline

    kw: dict = {"workers": int(workers)} if workers != "ray" else {}
    cluster = None
    if workers == "ray":
        from ray.cluster_utils import Cluster

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        head = {"num_cpus": 1, "include_dashboard": False}
        cluster = Cluster(initialize_head=True, head_node_args=head)
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        kw["ray"] = cluster.address
    # The compiled fp8 kernel's load (importing numba; once per process, whatever the
    # dataset's size), timed apart where the audit loads it before its workers start (an
    # fp8 corpus past MIN_BYTES): the audit below then finds it loaded.
    files = pipeline.expand_paths(roots)
    loads = sum(map(os.path.getsize, files)) >= decode.MIN_BYTES and decode.is_fp8(files[0])
    t0, c0 = time.perf_counter(), cpu_seconds()
    if loads:
        decode.enable(decode.MIN_BYTES)
    load = time.perf_counter() - t0
    arrivals: list[tuple[float, int]] = []  # each file's record: when, its bytes
    pace = os.environ.get("BENCH_PACE") != "0"  # off where the driver's RSS is the point

    def on_record(r: dict) -> None:
        if pace and r.get("type") == "file":
            arrivals.append((time.perf_counter(), int(r.get("bytes") or 0)))

    rep = pipeline.audit_paths(roots, on_record=on_record, keep=False, **kw)
    dt, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    # The scan's pace once under way: from the result that brought the bytes judged to
    # 10% of the whole to the one that brought them to 90%, the bytes that came back
    # between over the time between (what a run of 10^5 files sees between its start-up
    # and its dataset pass, both of which it pays once; a batch still in flight at
    # either end is left out at both, so it does not favour several workers).
    scan = None
    total = sum(b for _, b in arrivals)
    cum, marks = 0, []
    for t, b in arrivals:
        cum += b
        if (not marks and cum >= 0.1 * total) or (len(marks) == 1 and cum >= 0.9 * total):
            marks.append((t, cum))
    if len(marks) == 2 and marks[1][0] > marks[0][0]:
        scan = (marks[1][1] - marks[0][1]) / (marks[1][0] - marks[0][0])
    if cluster is not None:
        cluster.shutdown()
    with open("/proc/self/status") as f:
        hwm = next(int(x.split()[1]) for x in f if x.startswith("VmHWM:"))
    counts = {v: rep.count(v) for v in ("ok", "suspect", "corrupt", "pending", "unsupported")}
    print(json.dumps({"seconds": dt, "load": load, "counts": counts, "rss_kb": hwm, "cpu": cpu,
                      "scan_bytes_per_s": scan}))  # fmt: skip


def cpu_seconds() -> float:
    """CPU seconds of this process and its reaped children (the workers, or cat)."""
    import resource

    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def audit(roots: list[Path], workers: int | str, pace: bool = True) -> dict:
    cmd = [sys.executable, __file__, "--child", str(workers), *map(str, roots)]
    env = {**os.environ, "BENCH_PACE": "1" if pace else "0"}
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if out.returncode:
        raise RuntimeError(f"audit run failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench(name: str, root: Path, args: argparse.Namespace) -> tuple[bool, list[str]]:
    files = files_of(root)
    nbytes = sum(os.path.getsize(f) for f in files)
    sizes = sorted(os.path.getsize(f) for f in files)
    small = name == "small"
    print(
        f"\n{name}: {len(files)} files, {nbytes / 1e9:.3f} GB, file sizes "
        f"{sizes[0] / MB:.2f}-{sizes[-1] / MB:.2f} MB (median {sizes[len(sizes) // 2] / MB:.2f})"
    )
    workers: list[int | str] = [int(x) for x in args.workers.split(",")]
    if args.ray:
        workers.append("ray")
    print(f"{'rep':>3} {'run':<12} {'seconds':>8} {'GB/s':>7} {'files/s':>9} "
          f"{'x cat':>7} {'x cat/worker':>12} {'CPU s':>7} {'x cat CPU':>9} "
          f"{'driver RSS':>10} {'kernel load':>11} {'x cat/worker after it':>21}"
          + ("" if small else f" {'scan pace':>9}"))  # fmt: skip
    ratios: dict[int | str, list[float]] = {w: [] for w in workers}
    steady: dict[int | str, list[float]] = {w: [] for w in workers}
    pace: dict[int | str, list[float]] = {w: [] for w in workers}
    cpu_ratios: dict[int | str, list[float]] = {w: [] for w in workers}
    clean = True
    cat(files)  # into the page cache
    for r in range(args.repeat):
        dt_cat, cpu_cat = cat(files)
        print(f"{r:>3} {'cat':<12} {dt_cat:>8.3f} {nbytes / 1e9 / dt_cat:>7.2f} "
              f"{len(files) / dt_cat:>9.0f} {'':>7} {'':>12} {cpu_cat:>7.2f}")  # fmt: skip
        for w in workers:
            res = audit([root], w)
            dt = res["seconds"]
            x = dt_cat / dt
            per = 1 if small else (2 if w == "ray" else w)
            ratios[w].append(x / per)
            steady[w].append(dt_cat / (dt - res["load"]) / per)
            cpu_ratios[w].append(cpu_cat / res["cpu"])
            scan = ""
            if not small and res["scan_bytes_per_s"]:
                pace[w].append(res["scan_bytes_per_s"] / (nbytes / dt_cat) / per)
                scan = f" {pace[w][-1]:>9.3f}"
            run = f"audit w={w}"
            print(
                f"{r:>3} {run:<12} {dt:>8.3f} {nbytes / 1e9 / dt:>7.2f} {len(files) / dt:>9.0f} "
                f"{x:>7.3f} {ratios[w][-1]:>12.3f} {res['cpu']:>7.2f} {cpu_ratios[w][-1]:>9.3f} "
                f"{res['rss_kb'] / 1024:>7.0f} MB {res['load']:>9.2f} s {steady[w][-1]:>21.3f}"
                + scan
            )
            clean &= res["counts"]["ok"] == len(files)
            if res["counts"]["ok"] != len(files):
                print(f"    verdicts: {res['counts']}")
    lines = []
    for w in workers:
        med, best = statistics.median(ratios[w]), max(ratios[w])
        if small:
            what, goal = f"files/s w={w} / cat files/s", (0.25 if w == 2 else None)
        else:
            what, goal = f"GB/s per worker w={w} / cat GB/s", 0.6
        verdict = ""
        if goal is not None:
            verdict = f" (goal >= {goal:g}: {'met' if med >= goal else 'NOT met'})"
        lines.append(f"{name}: {what}: median {med:.3f}, best {best:.3f}{verdict}")
        lines.append(
            f"{name}: CPU per byte w={w}: cat CPU s / audit CPU s (driver + workers): "
            f"median {statistics.median(cpu_ratios[w]):.3f}"
        )
        if not small:
            lines.append(
                f"{name}: the same after the kernel's load (once per process: what a dataset "
                f"of 100 GB and more sees): median {statistics.median(steady[w]):.3f}"
            )
            if pace[w]:
                med_p, lo, hi = statistics.median(pace[w]), min(pace[w]), max(pace[w])
                lines.append(
                    f"{name}: scan pace w={w} (per worker, from 10% to 90% of the bytes "
                    f"judged: start-up and the dataset pass left out, as 10^5 files "
                    f"amortise them): median {med_p:.3f}, range {lo:.3f}-{hi:.3f} "
                    f"(goal >= 0.6: {'met' if med_p >= 0.6 else 'NOT met'})"
                )
    if small and args.parts_check:
        # Without the pace's per-file timestamps (about 0.17 KB a file of this driver).
        quarter = audit([root / "p0"], 2, pace=False)
        whole = audit([root], 2, pace=False)
        nq = len(files_of(root / "p0"))
        lines.append(
            f"{name}: driver peak RSS (w=2): {nq} files {quarter['rss_kb'] / 1024:.0f} MB, "
            f"{len(files)} files {whole['rss_kb'] / 1024:.0f} MB "
            f"({(whole['rss_kb'] - quarter['rss_kb']) / (len(files) - nq):.2f} KB per extra file)"
        )
    return clean, lines


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[3:], sys.argv[2])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpora", default="bf16,fp8,small", help="comma list (bf16,fp8,small)")
    ap.add_argument("--workers", default="1,2", help="comma list (default 1,2)")
    ap.add_argument("--repeat", type=int, default=3, help="repetitions (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/vllm-hsfix/bench-audit"))
    ap.add_argument("--no-parts-check", dest="parts_check", action="store_false",
                    help="skip the driver-RSS comparison of 1/4 and all small files")  # fmt: skip
    ap.add_argument("--no-ray", action="store_true", help="leave out the Ray run")
    args = ap.parse_args()
    try:
        import ray  # noqa: F401
    except ImportError:
        args.ray = False
    else:
        args.ray = not args.no_ray
    with open("/proc/cpuinfo") as f:
        models = [x.split(":", 1)[1].strip() for x in f if x.startswith("model name")]
    model = models[0] if models else platform.processor()
    print(
        f"machine: {os.cpu_count()} CPUs ({model}), load {os.getloadavg()[0]:.1f}, "
        f"Python {platform.python_version()}, numpy {np.__version__}; "
        f"Ray: {'2 local nodes x 1 CPU' if args.ray else 'not run'}"
    )
    summary: list[str] = []
    ok = True
    try:
        for name in args.corpora.split(","):
            root = build(name, CORPORA[name], Path(args.cache), args.seed)
            clean, lines = bench(name, root, args)
            ok &= clean
            summary += lines
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        print(f"cannot measure: {exc}")
        return 2
    print("\nsummary (ratios to cat of the same repetition):")
    for line in summary:
        print("  " + line)
    if not ok:
        print("FALSE POSITIVES: a clean corpus had files not judged ok")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
