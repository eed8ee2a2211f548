#!/usr/bin/env python3
"""Cost of the patched scatter, against the unpatched original and upstream's formula.

Run inside a vLLM environment (``python3 scripts/vllm_env.py exec 0.24.0 -- python
benchmarks/bench_scatter.py``), on the CPU here or on CUDA when there is one. All
variants run in the same process on the same inputs; the table prints median times
and ratios against upstream's fixed formula (``clamp_min(0)`` then the 2-D index, what
vLLM 0.25.0 runs). Nothing here is asserted: numbers go into the issue notes.

Variants:
  original   the release's own basic_cache (wrong: writes padding into the last block)
  patched    what vllm-hsfix installs (clamp, then one flattened index when the cache is
             contiguous, else the 2-D index)
  upstream   upstream 0.25.0's formula, written out: clamp, then kv[s // bs, s % bs] = x
  flat       one flattened index on a contiguous cache: kv.view(-1, h, d)[clamp(s)] = x
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from typing import Any

import torch

MODEL_MODULE = "vllm.model_executor.models.extract_hidden_states"


def upstream_formula(to_cache: Any, kv_cache: Any, slot_mapping: Any) -> None:
    block_size = kv_cache.shape[1]
    s = slot_mapping.clamp_min(0)
    kv_cache[s // block_size, s % block_size] = to_cache


def flat_index(to_cache: Any, kv_cache: Any, slot_mapping: Any) -> None:
    nb, bs = kv_cache.shape[0], kv_cache.shape[1]
    kv_cache.view(nb * bs, *kv_cache.shape[2:])[slot_mapping.clamp_min(0)] = to_cache


def timeit(fn: Any, args: tuple, device: str, reps: int) -> float:
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


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--full", action="store_true", help="hidden up to 8192, tokens up to 8192")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument(
        "--no-vllm",
        action="store_true",
        help="machine without vLLM: 'original' is the 0.22-0.24 formula, unclamped",
    )
    args = ap.parse_args()

    if args.no_vllm:
        from vllm_hsfix.patches.scatter import scatter_clamped as patched

        def original(to_cache: Any, kv_cache: Any, slot_mapping: Any) -> None:
            bs = kv_cache.shape[1]
            kv_cache[slot_mapping // bs, slot_mapping % bs] = to_cache
    else:
        import vllm_hsfix
        from vllm_hsfix.patches._wrap import patch_id_of

        vllm_hsfix.apply()
        module = importlib.import_module(MODEL_MODULE)
        patched = module.basic_cache
        original = patched.__wrapped__ if patch_id_of(patched) else patched
        if not patch_id_of(patched):
            print(
                f"note: basic_cache is not patched here ({vllm_hsfix.status()['vllm']['version']})"
            )

    if args.full:
        tokens, hiddens, auxes = [1, 16, 256, 2048, 8192], [2048, 4096, 8192], [1, 3, 6]
    else:
        tokens, hiddens, auxes = [1, 16, 256, 2048], [2048, 4096], [1, 3, 6]
    pads = [0.0, 0.1, 0.3]
    dev, dt = args.device, torch.bfloat16
    block_size = 22
    print(
        f"device={dev} dtype=bf16 block_size={block_size} reps={args.reps} "
        f"(median; ratio = variant / upstream formula)"
    )
    head = (
        f"{'tokens':>6} {'aux':>3} {'hidden':>6} {'pad':>4} | {'upstream us':>11} "
        f"{'patched':>8} {'original':>8} {'flat':>8} | flat==upstream bytes"
    )
    print(head)
    print("-" * len(head))
    ratios: dict[str, list[float]] = {"patched": [], "original": [], "flat": []}
    for n in tokens:
        for aux in auxes:
            for hidden in hiddens:
                if n * aux * hidden * 2 > (2 << 30):
                    continue
                for pad in pads if n > 1 else [0.0]:
                    n_pad = int(n * pad)
                    num_blocks = (n // block_size) + 8
                    gen = torch.Generator().manual_seed(n + aux + hidden)
                    real = torch.randperm((num_blocks - 1) * block_size, generator=gen)[: n - n_pad]
                    slots = torch.cat([real + block_size, torch.full((n_pad,), -1)])
                    slots = slots[torch.randperm(n, generator=gen)].to(dev)
                    x = torch.randn(n, aux, hidden, generator=gen).to(dt).to(dev)
                    kv = torch.zeros(num_blocks, block_size, aux, hidden, dtype=dt, device=dev)
                    a = (x, kv, slots)
                    t_up = timeit(upstream_formula, a, dev, args.reps)
                    t_pa = timeit(patched, a, dev, args.reps)
                    t_or = timeit(original, a, dev, args.reps)
                    t_fl = timeit(flat_index, a, dev, args.reps)
                    k1, k2 = kv.clone().zero_(), kv.clone().zero_()
                    upstream_formula(x, k1, slots)
                    flat_index(x, k2, slots)
                    # Block 0 slot 0 takes one of the padding rows (which one is unordered).
                    same = torch.equal(k1[1:], k2[1:]) and torch.equal(k1[0, 1:], k2[0, 1:])
                    for k, t in (("patched", t_pa), ("original", t_or), ("flat", t_fl)):
                        ratios[k].append(t / t_up)
                    print(
                        f"{n:>6} {aux:>3} {hidden:>6} {pad:>4.0%} | {t_up * 1e6:>11.1f} "
                        f"{t_pa / t_up:>8.3f} {t_or / t_up:>8.3f} {t_fl / t_up:>8.3f} | {same}"
                    )
    print("-" * len(head))
    for k, v in ratios.items():
        print(
            f"{k:>8} / upstream: median {statistics.median(v):.3f}, "
            f"min {min(v):.3f}, max {max(v):.3f} over {len(v)} shapes"
        )


if __name__ == "__main__":
    main()
