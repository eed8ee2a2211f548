#!/usr/bin/env python3
"""Cost of the patched scatter, against upstream's formula and the releases' originals.

Every variant runs in the same process, on the same inputs, on the CPU or on CUDA; the
table prints median times and ratios against upstream's fixed formula measured in the
same run (``slot_mapping.clamp_min(0)`` then the 2-D index ``kv[s // bs, s % bs] = x``,
what vLLM 0.25.0 runs). Timings are not asserted (a shared GPU is noisy), bytes are:
the run exits 1 when a fixed variant stores anything other than upstream's bytes
(outside the null block's slot 0, where padding goes), or when a release's original
does NOT write padding into the last slot of the last block (then the inputs do not
show the bug and the comparison means nothing).

Variants:
  upstream         the baseline: clamp, then the 2-D index (written out here)
  scatter_clamped  vllm-hsfix's replacement for the 2d-index shape (0.22-0.24): one
                   flattened index on a contiguous cache, the 2-D index on a strided view
  scatter_flat     vllm-hsfix's replacement for the flat-view shape (0.17-0.21);
                   contiguous caches only, as the releases it replaces
  installed        (with vLLM) the live, patched ``basic_cache``
  orig-live        (with vLLM) the release's own function beneath it (``__wrapped__``)
  orig-<release>   a release's own, unclamped ``basic_cache``, compiled from the files
                   ``scripts/gpu_release_code.py`` copies (``--release-code DIR``; no vLLM
                   needed: what the GPU machine runs)

Layouts: ``contiguous`` and ``strided`` (a view of a buffer with 3 spare slots per
block, as padded pages give from 0.22 on); flat-view functions cannot take the latter.

  python3 scripts/vllm_env.py exec 0.24.0 -- python benchmarks/bench_scatter.py
  python benchmarks/bench_scatter.py --device cuda --no-vllm --release-code gpu-release-code --full
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
MODEL_MODULE = "vllm.model_executor.models.extract_hidden_states"
BLOCK_SIZE = 22
STRIDE_PAD = 3


def upstream_formula(to_cache: Any, kv_cache: Any, slot_mapping: Any) -> None:
    block_size = kv_cache.shape[1]
    s = slot_mapping.clamp_min(0)
    kv_cache[s // block_size, s % block_size] = to_cache


@dataclass
class Variant:
    name: str
    fn: Callable[..., Any]
    strided_ok: bool  # can take a strided view (flat-view functions cannot)
    fixed: bool  # must store upstream's bytes; else an original, which must show the bug


def _gpu_release_code() -> Any:
    spec = importlib.util.spec_from_file_location(
        "gpu_release_code", ROOT / "scripts" / "gpu_release_code.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def release_originals(code_dir: Path) -> list[Variant]:
    """Each release's own ``basic_cache`` under ``code_dir`` (``vllm-<X>/...``)."""
    from vllm_hsfix.patches.scatter_clamp.fix import probe_tree

    grc = _gpu_release_code()
    out = []
    for sub in sorted(code_dir.glob("vllm-*")):
        path = sub / grc.FILENAME
        if not path.is_file():
            continue
        shape = probe_tree(ast.parse(path.read_text())).shape
        release = sub.name.removeprefix("vllm-")
        out.append(
            Variant(f"orig-{release}", grc.compile_basic_cache(path), shape == "2d-index", False)
        )
    return out


def live_variants() -> list[Variant]:
    """The installed vLLM's ``basic_cache``, patched, and the release's own beneath it."""
    import vllm_hsfix
    from vllm_hsfix.patches.scatter_clamp.fix import probe_tree

    vllm_hsfix.apply()
    module = importlib.import_module(MODEL_MODULE)
    release = vllm_hsfix.status()["vllm"]["version"]
    shape = probe_tree(ast.parse(Path(module.__file__ or "").read_text())).shape
    live = module.basic_cache
    if not getattr(live, "hsfix_patch", None):
        print(f"note: basic_cache is not patched here (vLLM {release}): no original to time")
        return [Variant("installed", live, True, True)]
    return [
        Variant("installed", live, shape != "flat-view", True),
        Variant("orig-live", live.__wrapped__, shape != "flat-view", False),
    ]


def timeit(fn: Any, args: tuple[Any, ...], device: str, reps: int) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        fn(*args)
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_inputs(
    n: int, aux: int, hidden: int, pad: float, strided: bool, device: str, seed: int
) -> tuple[Any, Any, Any, Any]:
    """Rows, a cache (or a strided view), slots with ``-1`` padding mixed in, and the
    whole buffer. Real slots avoid block 0 and the buffer's last slot, so padding
    written there is visible."""
    n_pad = int(n * pad)
    num_blocks = n // BLOCK_SIZE + 8
    gen = torch.Generator().manual_seed(seed)
    usable = num_blocks * BLOCK_SIZE - BLOCK_SIZE - 1
    real = torch.randperm(usable, generator=gen)[: n - n_pad] + BLOCK_SIZE
    slots = torch.cat([real, torch.full((n_pad,), -1)])
    slots = slots[torch.randperm(n, generator=gen)].to(device)
    dgen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, aux, hidden, generator=dgen, device=device, dtype=torch.bfloat16)
    width = BLOCK_SIZE + (STRIDE_PAD if strided else 0)
    base = torch.zeros(num_blocks, width, aux, hidden, dtype=torch.bfloat16, device=device)
    kv = base[:, :BLOCK_SIZE] if strided else base
    return x, kv, slots, base


def bytes_problem(v: Variant, x: Any, kv: Any, slots: Any, base: Any, ref: Any) -> str | None:
    """Run ``v`` on a fresh buffer; what is wrong with the result, if anything."""
    base.zero_()
    v.fn(x, kv, slots)
    if v.fixed:
        got, want = base.clone(), ref.clone()
        got[0, 0] = want[0, 0]  # the null block's slot 0 takes any one padding row
        return None if torch.equal(got, want) else f"{v.name}: bytes differ from upstream's"
    has_padding = bool((slots < 0).any())
    hit = bool(kv[-1, -1].ne(0).any())
    if has_padding and not hit:
        return f"{v.name}: padding did not reach the last slot (the bug does not show)"
    got, want = kv.clone(), ref[:, : kv.shape[1]].clone()
    got[0, 0], got[-1, -1] = want[0, 0], want[-1, -1]
    if not torch.equal(got, want):
        return f"{v.name}: real rows differ from upstream's"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--full", action="store_true", help="hidden up to 8192, tokens up to 8192")
    ap.add_argument("--quick", action="store_true", help="a few small shapes (smoke run)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-vllm", action="store_true", help="machine without vLLM")
    ap.add_argument(
        "--release-code",
        type=Path,
        help="folder written by scripts/gpu_release_code.py: time the releases' originals",
    )
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2

    from vllm_hsfix.patches.scatter_clamp.fix import scatter_clamped, scatter_flat

    variants = [
        Variant("scatter_clamped", scatter_clamped, True, True),
        Variant("scatter_flat", scatter_flat, False, True),
    ]
    if not args.no_vllm:
        variants += live_variants()
    if args.release_code is not None:
        originals = release_originals(args.release_code)
        if not originals:
            print(f"no release code under {args.release_code}", file=sys.stderr)
            return 1
        variants += originals

    if args.quick:
        tokens, hiddens, auxes = [1, 64, 512], [256], [1, 3]
    elif args.full:
        tokens, hiddens, auxes = [1, 16, 256, 2048, 8192], [2048, 4096, 8192], [1, 3, 6]
    else:
        tokens, hiddens, auxes = [1, 16, 256, 2048], [2048, 4096], [1, 3, 6]
    pads = [0.0, 0.1, 0.3]
    dev = args.device
    print(
        f"device={dev} ({torch.cuda.get_device_name(0) if dev == 'cuda' else 'cpu'}) "
        f"torch={torch.__version__} dtype=bf16 block_size={BLOCK_SIZE} reps={args.reps}"
    )
    print("median time of upstream's formula; every other column: variant / upstream")
    names = [v.name for v in variants]
    head = (
        f"{'tokens':>6} {'aux':>3} {'hidden':>6} {'pad':>4} {'layout':>10} | {'upstream us':>11} "
        + " ".join(f"{n:>15}" for n in names)
    )
    print(head)
    print("-" * len(head))
    ratios: dict[tuple[str, str], list[float]] = {}
    problems: list[str] = []
    rows = 0
    for n in tokens:
        for aux in auxes:
            for hidden in hiddens:
                if n * aux * hidden * 2 > (2 << 30):
                    continue
                for pad in pads if n > 1 else [0.0]:
                    for layout in ("contiguous", "strided"):
                        seed = n + aux + hidden + int(pad * 100)
                        x, kv, slots, base = make_inputs(
                            n, aux, hidden, pad, layout == "strided", dev, seed
                        )
                        a = (x, kv, slots)
                        t_up = timeit(upstream_formula, a, dev, args.reps)
                        base.zero_()
                        upstream_formula(*a)
                        ref = base.clone()
                        cells = []
                        for v in variants:
                            if layout == "strided" and not v.strided_ok:
                                cells.append(f"{'-':>15}")
                                continue
                            t = timeit(v.fn, a, dev, args.reps)
                            ratios.setdefault((v.name, layout), []).append(t / t_up)
                            problem = bytes_problem(v, x, kv, slots, base, ref)
                            if problem:
                                problems.append(
                                    f"{n}x{aux}x{hidden} pad {pad:.0%} {layout}: {problem}"
                                )
                            cells.append(f"{t / t_up:>14.3f}{'!' if problem else ' '}")
                        rows += 1
                        print(
                            f"{n:>6} {aux:>3} {hidden:>6} {pad:>4.0%} {layout:>10} | "
                            f"{t_up * 1e6:>11.1f} " + " ".join(cells),
                            flush=True,
                        )
                        del x, kv, slots, base, ref
    print("-" * len(head))
    for (name, layout), v in ratios.items():
        print(
            f"{name:>15} {layout:>10} / upstream: median {statistics.median(v):.3f}, "
            f"min {min(v):.3f}, max {max(v):.3f} over {len(v)} shapes"
        )
    if problems:
        print(f"BAD: {len(problems)} byte problem(s) ('!' above):")
        for p in problems[:20]:
            print(f"  {p}")
        return 1
    print(
        f"bytes: every fixed variant stored upstream's bytes and every original wrote "
        f"padding into the last slot where there was padding ({rows} shape/layout rows)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
