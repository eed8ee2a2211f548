#!/usr/bin/env python3
"""How fast is ``vllm-hsfix audit`` next to just reading the same bytes?

Two corpora shaped like ``ExampleHiddenStatesConnector`` output (3 aux layers, bf16;
3 of 4 files start with a shared 24-token template, as chat-templated prompts do):

* large: up to 200 files of 128-2048 tokens, hidden 2048, about 1 GB (``--total-gb``):
  the bytes set the pace; reported in GB/s;
* small: 20,000 files of 16-48 tokens, hidden 256 (``--small-files``, ``--small-hidden``):
  the per-file cost sets the pace; reported in files/s.

For each, in one run and in this order: raw read #1 (``cat FILES > /dev/null``, the
corpus was just written, so usually a cached read), the audit with 1 and 2 worker
processes (``audit_paths`` with the pool's start-up, as the CLI pays it), the audit
on a local Ray cluster of 2 nodes with 1 CPU each (``ray.cluster_utils.Cluster``;
only where Ray is installed: run this script in the ``ray`` venv, it needs numpy and
Ray only), then raw read #2. Each run's speed is printed beside raw read #1's as a
ratio (higher is better; the issue's goals: large >= 0.6 of raw per worker, small
>= 0.25 of ``cat``'s files/s). The corpora are clean, so anything but "ok" is a false
positive. Nothing here is asserted by the test suite.

    python benchmarks/bench_audit.py                      # both corpora
    python benchmarks/bench_audit.py --small-files 0 --total-gb 0.5   # large only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_hsfix.audit import pipeline, reports


def layer_scales(n_aux: int) -> np.ndarray:
    """Each aux layer's own scale, as real layers have different norms."""
    return np.array([1.0, 4.0, 16.0][:n_aux] + [1.0] * max(0, n_aux - 3), dtype=np.float32)


def write_file(
    path: Path,
    tokens: int,
    n_aux: int,
    hidden: int,
    rng: np.random.Generator,
    prefix: tuple[np.ndarray, np.ndarray] | None = None,
) -> int:
    """One bf16 safetensors file, written through a memmap a slab of tokens at a time.
    Each aux layer gets its own scale, as real layers have different norms. ``prefix``
    (ids, rows) is written first: the shared template every chat prompt starts with."""
    n_hs = tokens * n_aux * hidden * 2
    header = {
        "hidden_states": {
            "dtype": "BF16",
            "shape": [tokens, n_aux, hidden],
            "data_offsets": [0, n_hs],
        },
        "token_ids": {"dtype": "I64", "shape": [tokens], "data_offsets": [n_hs, n_hs + 8 * tokens]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    size = start + n_hs + 8 * tokens
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(size)
    hs = np.memmap(path, dtype="<u2", mode="r+", offset=start, shape=(tokens, n_aux, hidden))
    scale = layer_scales(n_aux)
    for t in range(0, tokens, 512):
        block = rng.standard_normal((min(512, tokens - t), n_aux, hidden), dtype=np.float32)
        block *= scale[None, :, None]
        hs[t : t + 512] = (block.view(np.uint32) >> 16).astype(np.uint16)
    if prefix is not None:
        k = min(tokens, len(prefix[0]))
        hs[:k] = prefix[1][:k]
    hs.flush()
    del hs
    ids = np.memmap(path, dtype="<i8", mode="r+", offset=start + n_hs, shape=(tokens,))
    ids[:] = rng.integers(0, 150_000, size=tokens)
    # Rows here are random, not causal: a file without the template gets a first token
    # no other file has, so only files that really share rows share a prefix.
    ids[0] = 200_000 + int(path.stem.rsplit("-", 1)[-1])
    if prefix is not None:
        ids[: min(tokens, len(prefix[0]))] = prefix[0][:tokens]
    ids.flush()
    del ids
    return size


def make_corpus(root: Path, args: argparse.Namespace) -> list[str]:
    """Files of random length until ``--total-gb`` or ``--files`` is reached."""
    rng = np.random.default_rng(args.seed)
    budget = int(args.total_gb * 1e9)
    prefix = None
    if args.shared_prefix:
        n = args.shared_prefix
        rows = rng.standard_normal((n, args.n_aux, args.hidden), dtype=np.float32)
        rows *= layer_scales(args.n_aux)[None, :, None]
        prefix = (
            rng.integers(0, 150_000, size=n),
            (rows.view(np.uint32) >> 16).astype(np.uint16),
        )
    files: list[str] = []
    total = 0
    while len(files) < args.files and total < budget:
        tokens = int(rng.integers(args.min_tokens, args.max_tokens + 1))
        path = root / f"req-{len(files):05d}.safetensors"
        shared = prefix if len(files) % 4 else None  # 3 of 4 files start with the template
        total += write_file(path, tokens, args.n_aux, args.hidden, rng, shared)
        (root / f"{path.name}.lock").touch()  # the connector leaves these beside
        files.append(str(path))
    return files


def raw_read(files: list[str]) -> float:
    """``cat`` the files to /dev/null (in batches, to stay under ARG_MAX)."""
    t0 = time.perf_counter()
    for i in range(0, len(files), 500):
        subprocess.run(["cat", *files[i : i + 500]], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def timed_audit(root: Path, repeat: int, **kw: object) -> tuple[float, reports.AuditReport]:
    """Best of ``repeat`` runs of ``audit_paths`` on the corpus directory."""
    best, report = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        rep = pipeline.audit_paths([root], **kw)  # type: ignore[arg-type]
        dt = time.perf_counter() - t0
        if dt < best:
            best, report = dt, rep
    assert report is not None
    return best, report


def ray_cluster() -> object | None:
    """A local Ray cluster of 2 nodes with 1 CPU each, or None without Ray."""
    try:
        from ray.cluster_utils import Cluster
    except ImportError:
        return None
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    return c


def bench(name: str, root: Path, args: argparse.Namespace, cluster: object | None) -> bool:
    """One corpus: the runs, one table; False when a file was not judged ok."""
    files = pipeline.expand_paths([root])
    nbytes = sum(os.path.getsize(f) for f in files)
    rows: list[tuple[str, float]] = [("raw read #1 (cat)", raw_read(files))]
    counts = {}
    for w in (int(x) for x in args.workers.split(",")):
        dt, rep = timed_audit(root, args.repeat, workers=w)
        rows.append((f"audit, {w} worker{'s' * (w > 1)}", dt))
        counts[rows[-1][0]] = (rep.count("ok"), rep.count("suspect"), rep.count("corrupt"))
    if cluster is not None:
        dt, rep = timed_audit(root, args.repeat, ray=cluster.address)  # type: ignore[attr-defined]
        rows.append(("audit, Ray 2 nodes", dt))
        counts[rows[-1][0]] = (rep.count("ok"), rep.count("suspect"), rep.count("corrupt"))
    rows.append(("raw read #2 (cat)", raw_read(files)))
    raw1 = rows[0][1]
    print(f"\n{name}: {len(files)} files, {nbytes / 1e9:.3f} GB")
    print(f"{'run':<22} {'seconds':>8} {'GB/s':>8} {'files/s':>9} {'x raw #1':>9}")
    for run, dt in rows:
        print(
            f"{run:<22} {dt:>8.3f} {nbytes / 1e9 / dt:>8.2f} {len(files) / dt:>9.1f} "
            f"{raw1 / dt:>9.3f}"
        )
    clean = True
    for run, (ok, suspect, corrupt) in counts.items():
        print(f"verdicts ({run}): ok {ok}, suspect {suspect}, corrupt {corrupt}")
        clean &= ok == len(files)
    return clean


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total-gb", type=float, default=1.0, help="large corpus size (1.0)")
    ap.add_argument("--files", type=int, default=200, help="large corpus: at most this many")
    ap.add_argument("--min-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--n-aux", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--small-files", type=int, default=20_000, help="0: no small corpus")
    ap.add_argument("--small-hidden", type=int, default=256)
    ap.add_argument("--workers", default="1,2", help="comma list (default 1,2)")
    ap.add_argument("--no-ray", action="store_true", help="leave out the Ray run")
    ap.add_argument("--repeat", type=int, default=1, help="best of N audit runs (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--shared-prefix",
        type=int,
        default=24,
        help="3 of 4 files start with the same N tokens and rows (default 24; 0: none)",
    )
    ap.add_argument("--dir", default=None, help="where to build the corpora (default: a tmp dir)")
    ap.add_argument("--keep", action="store_true", help="leave the corpora on disk")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench-audit-", dir=args.dir))
    cluster = None if args.no_ray else ray_cluster()
    print(
        f"machine: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"numpy {np.__version__}; Ray: {'2 local nodes x 1 CPU' if cluster else 'not run'}"
    )
    ok = True
    try:
        corpora = [("large", args.total_gb, args.files, args.min_tokens, args.max_tokens,
                    args.hidden)]  # fmt: skip
        if args.small_files:
            corpora.append(("small", 1e9, args.small_files, 16, 48, args.small_hidden))
        for name, gb, n, lo, hi, hidden in corpora:
            sub = root / name
            sub.mkdir()
            t0 = time.perf_counter()
            shape = {"min_tokens": lo, "max_tokens": hi, "hidden": hidden}
            spec = argparse.Namespace(**{**vars(args), "total_gb": gb, "files": n, **shape})
            make_corpus(sub, spec)
            print(f"{name} corpus written in {time.perf_counter() - t0:.1f} s "
                  f"({lo}-{hi} tokens, hidden {hidden})")  # fmt: skip
            ok &= bench(name, sub, args, cluster)
    finally:
        if cluster is not None:
            cluster.shutdown()  # type: ignore[attr-defined]
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    if not ok:
        print("FALSE POSITIVES: a clean corpus had files not judged ok")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
