"""``scatter-clamp``: padding slots go to the null block, not into a live block.

vLLM pads batches (CUDA graphs) with slot ``-1``. ``basic_cache`` in 0.17.0-0.24.0
scatters the hidden states of every slot unchecked, and ``-1`` indexes the LAST slot
of the LAST block: a block that can belong to a running request (and, from 0.22, a
buffer shared with other KV-cache groups). Upstream (PR 46301, vLLM 0.25.0) clamps
the slots at 0 first; block 0 is vLLM's null block and is never given to a request.

The shape gate recognises the function exactly (statement by statement, operands
included, whatever the variables are called; see ``shapes.body_template``):

``flat-view`` (0.17-0.21)
    unpack ``kv_cache.shape`` into four, view the cache as ``[blocks * block_size,
    heads, head]``, store the rows at ``slot_mapping``;
``2d-index`` (0.22-0.24)
    ``block_size = kv_cache.shape[1]``, store at
    ``kv_cache[slot_mapping // block_size, slot_mapping % block_size]``;
fixed (0.25, and the head-major form of 0.29+)
    the same with ``slot_mapping = slot_mapping.clamp_min(0)`` first.

Anything else, e.g. a head-major store ``kv_cache[s // bs, :, s % bs]`` without the
clamp, or an extra statement, is refused: the replacement never calls the release's
function, so it must only ever stand in for a layout it knows. The replacement is
built for the recognised shape, both of which put blocks first and slots second:

* contiguous cache: one flattened index, ``kv_cache.view(-1, heads, head)[slot] = x``
  (the same bytes as the 2-D index, fewer kernels: ``benchmarks/bench_scatter.py``);
* ``2d-index`` on a strided view of the buffer (padded pages, possible from 0.22):
  the 2-D index, the only form that addresses it correctly. ``flat-view`` releases
  view the cache, which fails on a strided one exactly as the release itself does.

``clamp_min`` is one elementwise kernel and ``is_contiguous`` reads tensor metadata on
the host: no branch on data, no host-device sync, capturable in a CUDA graph. The
release's own function stays reachable as ``__wrapped__`` and comes back on revert.
"""

from __future__ import annotations

import ast
from typing import Any

from ..shapes import Probe, body_template, fingerprint, template_of, top_level
from ._probe import probe_live
from ._wrap import Replacement, wrap
from .hooks import Hooks

PATCH_ID = "scatter-clamp"
ATTRIBUTE = "basic_cache"
PARAMS = ("to_cache", "kv_cache", "slot_mapping")

# The known bodies, written with our own names; only their structure is compared.
FLAT_VIEW = template_of(
    """
def f(rows, cache, slots):
    a, b, c, d = cache.shape
    flat = cache.view(a * b, c, d)
    flat[slots] = rows
"""
)
TWO_D_INDEX = template_of(
    """
def f(rows, cache, slots):
    n = cache.shape[1]
    cache[slots // n, slots % n] = rows
"""
)
FIXED_TWO_D = template_of(
    """
def f(rows, cache, slots):
    n = cache.shape[1]
    slots = slots.clamp_min(0)
    cache[slots // n, slots % n] = rows
"""
)
FIXED_HEAD_MAJOR = template_of(
    """
def f(rows, cache, slots):
    n = cache.shape[2]
    slots = slots.clamp_min(0)
    cache[slots // n, :, slots % n] = rows
"""
)
SHAPES = {FLAT_VIEW: "flat-view", TWO_D_INDEX: "2d-index"}
FIXED_SHAPES = {FIXED_TWO_D: "clamped 2-D index", FIXED_HEAD_MAJOR: "clamped head-major index"}


def scatter_flat(to_cache: Any, kv_cache: Any, slot_mapping: Any) -> None:
    """``flat-view`` with the slots clamped: padding (< 0) goes to slot 0."""
    slots = slot_mapping.clamp_min(0)
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1]
    kv_cache.view(num_blocks * block_size, *kv_cache.shape[2:])[slots] = to_cache


def scatter_clamped(to_cache: Any, kv_cache: Any, slot_mapping: Any) -> None:
    """``2d-index`` with the slots clamped: padding (< 0) goes to slot 0."""
    slots = slot_mapping.clamp_min(0)
    if kv_cache.is_contiguous():
        num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1]
        kv_cache.view(num_blocks * block_size, *kv_cache.shape[2:])[slots] = to_cache
    else:
        block_size = kv_cache.shape[1]
        kv_cache[slots // block_size, slots % block_size] = to_cache


REPLACEMENTS = {"flat-view": scatter_flat, "2d-index": scatter_clamped}


def _installed(scatter: Any) -> Any:
    def basic_cache(
        wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        return scatter(*args, **kwargs)

    return basic_cache


def probe_tree(tree: ast.Module) -> Probe:
    """Recognise the ``basic_cache`` shapes of 0.17.0-0.24.0 and upstream's fixed ones."""
    fn = top_level(tree, ATTRIBUTE)
    fps = {ATTRIBUTE: fingerprint(fn)}
    if not isinstance(fn, ast.FunctionDef):
        return Probe(None, detail=f"no function {ATTRIBUTE} in the module", fingerprints=fps)
    params = tuple(a.arg for a in fn.args.args)
    if params != PARAMS or fn.args.vararg or fn.args.kwarg or fn.args.kwonlyargs:
        return Probe(None, detail=f"expected parameters {PARAMS}, found {params}", fingerprints=fps)
    body = body_template(fn)
    if body in FIXED_SHAPES:
        return Probe(
            None, fixed=True, detail=f"slots are clamped ({FIXED_SHAPES[body]})", fingerprints=fps
        )
    if body in SHAPES:
        return Probe(SHAPES[body], detail=f"unclamped {SHAPES[body]} store", fingerprints=fps)
    return Probe(
        None,
        detail=(
            "the body is none of the known stores: flat view of a [blocks, block_size, ...] "
            "cache (0.17-0.21), kv_cache[slot // bs, slot % bs] (0.22-0.24), or either "
            "clamped (upstream's fix)"
        ),
        fingerprints=fps,
    )


def live_objects(module: object) -> dict[str, object]:
    return {ATTRIBUTE: getattr(module, ATTRIBUTE, None)}


def probe(module: object) -> Probe:
    return probe_live(module, probe_tree, live_objects)


def apply(module: object, shape: str, hooks: Hooks) -> list[Replacement]:
    """Install the clamped scatter written for ``shape`` (a name from :data:`SHAPES`)."""
    return [wrap(module, ATTRIBUTE, _installed(REPLACEMENTS[shape]), PATCH_ID)]
