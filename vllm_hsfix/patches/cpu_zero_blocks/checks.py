"""The live check of ``cpu-zero-blocks``: a real ``CPUModelRunner`` (without its heavy
``__init__``) on a real hybrid ``KVCacheConfig``, its attention view in the release's
own CPU layout (``CPUAttentionBackend.get_kv_cache_shape``)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

ZEROING_BLOCKS = 8


def attention_view(buffer: Any, num_blocks: int, block_size: int) -> tuple[Any, int]:
    """``buffer`` viewed as the release's CPU attention backend lays out a KV cache of
    2 KV heads of 64, and its block axis: the one axis that follows ``num_blocks``."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    layout = getattr(CPUAttentionBackend, "get_kv_cache_shape", None)
    if layout is None:  # 0.32.0: no such method on the backend; its cache is blocks first
        return buffer.view(num_blocks, 2, block_size, 128), 0
    shape = tuple(layout(num_blocks, block_size, 2, 64))
    more = tuple(layout(num_blocks + 1, block_size, 2, 64))
    (axis,) = [i for i, (a, b) in enumerate(zip(shape, more, strict=True)) if a != b]
    return buffer.view(shape), axis


def cpu_runner_case(cls: type, kv_split: int = 1) -> tuple[Any, dict[str, Any]]:
    """A real ``CPUModelRunner`` (without its heavy ``__init__``) with a real hybrid
    ``KVCacheConfig``: one buffer shared by mamba and attention, NaN everywhere; the
    attention view in the release's layout, ``kv_split`` kernel blocks per block."""
    import torch
    from vllm.config import CompilationConfig

    k = importlib.import_module("vllm.v1.kv_cache_interface")
    n = ZEROING_BLOCKS
    shared = torch.full((n, 4096), float("nan"), dtype=torch.bfloat16)
    attn, axis = attention_view(shared, n * kv_split, 16 // kv_split)
    mamba = shared.view(torch.float32)[:, :1024]  # another group's view of the same bytes
    hidden = torch.full((n, 16, 2, 256), float("nan"), dtype=torch.bfloat16)
    groups = [
        k.KVCacheGroupSpec(
            ["model.layers.0.linear_attn"],
            k.MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,)),
        ),
        k.KVCacheGroupSpec(
            ["model.layers.1.self_attn.attn"],
            k.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16),
        ),
    ]
    # The attention view block by block (a view: what the live method zeroes shows).
    buffers = {"attention": attn.movedim(axis, 0).unflatten(0, (n, kv_split))}
    context: dict[str, Any] = {
        "model.layers.0.linear_attn": SimpleNamespace(kv_cache=mamba),
        "model.layers.1.self_attn.attn": SimpleNamespace(kv_cache=attn),
    }
    if hasattr(k, "HiddenStateCacheSpec"):
        groups.append(
            k.KVCacheGroupSpec(
                ["cache_only_layers.0"],
                k.HiddenStateCacheSpec(
                    block_size=16, num_kv_heads=2, head_size=256, dtype=torch.bfloat16
                ),
            )
        )
        context["cache_only_layers.0"] = SimpleNamespace(kv_cache=hidden)
        buffers["hidden"] = hidden
    runner = object.__new__(cls)
    runner.kv_cache_config = k.KVCacheConfig(
        num_blocks=n, kv_cache_tensors=[], kv_cache_groups=groups
    )
    runner.compilation_config = CompilationConfig()
    runner.compilation_config.static_forward_context = context
    return runner, buffers


def zeroed_blocks(t: Any) -> list[int]:
    """Blocks of ``t`` (blocks first) whose bytes are all zero."""
    flat = t.reshape(t.shape[0], -1)
    return [b for b in range(t.shape[0]) if bool((flat[b] == 0).all())]


def check_zeroing(
    cls: type, blocks: tuple[int, ...] = (2, 5), splits: tuple[int, ...] = (1, 2)
) -> list[str]:
    """What is wrong after the live ``cls._zero_block_ids``: listed blocks must be zero,
    others unchanged. ``splits``: kernel blocks per block in the attention view."""
    problems: list[str] = []
    for kv_split in splits:
        runner, buffers = cpu_runner_case(cls, kv_split)
        runner._zero_block_ids(list(blocks))
        for name, buf in buffers.items():
            got = zeroed_blocks(buf)
            if got != list(blocks):
                problems.append(
                    f"kernel split {kv_split}: {name} buffer has blocks {got} zeroed, "
                    f"expected {list(blocks)}"
                )
            others = [b for b in range(buf.shape[0]) if b not in blocks]
            if not bool(buf[others].isnan().all()):
                problems.append(f"kernel split {kv_split}: {name} buffer: unlisted blocks changed")
    return problems
