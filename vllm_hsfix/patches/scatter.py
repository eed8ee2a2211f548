"""``scatter-clamp``: padding slots go to the null block, not into a live block.

vLLM pads batches (CUDA graphs) with slot ``-1``. ``basic_cache`` in 0.17.0-0.24.0
scatters the hidden states of every slot unchecked, and ``-1`` indexes the LAST slot
of the LAST block: a block that can belong to a running request (and, from 0.22, a
buffer shared with other KV-cache groups). Upstream (PR 46301, vLLM 0.25.0) clamps
the slots at 0 first; block 0 is vLLM's null block and is never given to a request.

The replacement does what both known shapes do (the shape gate has checked the
release's function is one of them), with the slots clamped first:

* contiguous cache: one flattened index, ``kv_cache.view(-1, heads, head)[slot] = x``.
  This is what 0.17-0.21 write, and gives the same bytes as 0.22-0.24's 2-D index
  ``kv_cache[slot // bs, slot % bs]`` while launching fewer kernels (no ``//``/``%``),
  measured in ``benchmarks/bench_scatter.py``;
* strided view of the buffer (padded pages, possible from 0.22): the 2-D index, the
  only form that addresses it correctly.

``clamp_min`` is one elementwise kernel and ``is_contiguous`` reads tensor metadata on
the host: no branch on data, no host-device sync, capturable in a CUDA graph (a check
such as ``(slot_mapping < 0).any()`` would sync and break capture). The release's own
function stays reachable as ``__wrapped__`` and comes back on ``unapply()``.
"""

from __future__ import annotations

import ast
from typing import Any

from .. import gate
from ._wrap import Replacement, wrap

PATCH_ID = "scatter-clamp"
ATTRIBUTE = "basic_cache"
PARAMS = ("to_cache", "kv_cache", "slot_mapping")


def scatter_clamped(to_cache: Any, kv_cache: Any, slot_mapping: Any) -> None:
    """Write ``to_cache`` rows into their slots; padding slots (< 0) go to slot 0."""
    slots = slot_mapping.clamp_min(0)
    if kv_cache.is_contiguous():
        num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1]
        kv_cache.view(num_blocks * block_size, *kv_cache.shape[2:])[slots] = to_cache
    else:
        block_size = kv_cache.shape[1]
        kv_cache[slots // block_size, slots % block_size] = to_cache


def clamp_padding_slots(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The installed ``basic_cache``: same signature, padding sent to the null block."""
    return scatter_clamped(*args, **kwargs)


def _stores_into(tree: ast.AST) -> list[ast.Subscript]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            out += [t for t in node.targets if isinstance(t, ast.Subscript)]
    return out


def probe_tree(tree: ast.Module) -> gate.Probe:
    """Recognise the ``basic_cache`` shapes of 0.17.0-0.24.0 and upstream's fixed one."""
    fn = gate.top_level(tree, ATTRIBUTE)
    fps = {ATTRIBUTE: gate.fingerprint(fn)}
    if not isinstance(fn, ast.FunctionDef):
        return gate.Probe(None, detail=f"no function {ATTRIBUTE} in the module", fingerprints=fps)
    chains = gate.attribute_chains(fn)
    called = {c.rsplit(".", 1)[-1] for c in chains}
    if {"clamp_min", "clamp", "clip"} & called or any(
        isinstance(n, ast.Compare) and "slot_mapping" in gate.names(n) for n in ast.walk(fn)
    ):
        return gate.Probe(None, fixed=True, detail="slots are already clamped", fingerprints=fps)
    params = tuple(a.arg for a in fn.args.args)
    if params[:3] != PARAMS:
        return gate.Probe(
            None, detail=f"expected parameters {PARAMS}, found {params}", fingerprints=fps
        )
    stores = _stores_into(fn)
    flat = "kv_cache.view" in chains and any(
        isinstance(s.slice, ast.Name) and s.slice.id == "slot_mapping" for s in stores
    )
    two_d = "kv_cache.shape" in chains and any(
        isinstance(s.value, ast.Name)
        and s.value.id == "kv_cache"
        and isinstance(s.slice, ast.Tuple)
        and {type(e.op) for e in s.slice.elts if isinstance(e, ast.BinOp)}
        == {ast.FloorDiv, ast.Mod}
        for s in stores
    )
    if flat:
        return gate.Probe("flat-view", detail="kv_cache.view(-1, ...)[slot] = x", fingerprints=fps)
    if two_d:
        return gate.Probe(
            "2d-index", detail="kv_cache[slot // bs, slot % bs] = x", fingerprints=fps
        )
    return gate.Probe(
        None,
        detail=(
            "expected an unclamped scatter, kv_cache.view(...)[slot_mapping] = to_cache "
            "(0.17-0.21) or kv_cache[slot_mapping // block_size, slot_mapping % block_size] "
            f"= to_cache (0.22-0.24); found a body reading {sorted(chains)}"
        ),
        fingerprints=fps,
    )


def live_objects(module: object) -> dict[str, object]:
    return {ATTRIBUTE: getattr(module, ATTRIBUTE, None)}


def probe(module: object) -> gate.Probe:
    return gate.probe_live(module, probe_tree, live_objects)


def apply(module: object) -> list[Replacement]:
    rep = wrap(module, ATTRIBUTE, clamp_padding_slots, PATCH_ID)
    return [rep] if rep else []
