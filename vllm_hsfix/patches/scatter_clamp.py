"""``scatter-clamp``: padding slots (``-1``) go to the null block, not into the last
slot of a live block (docs/patches.md). Goes when: 0.24.x is no longer supported.
"""

from __future__ import annotations

import ast
import sys
from typing import Any

from .. import checks
from ..shapes import Probe, body_template, template_of, top_level
from ._probe import expect, fingerprints, params, probes
from ._wrap import Replacement, wrap
from .hooks import Hooks

PATCH_ID = "scatter-clamp"
ATTRIBUTE = "basic_cache"


# The fix, upstream's ``slot_mapping.clamp_min(0)``, written per recognised shape (a
# contiguous cache through one flat index); no host sync, capturable in a CUDA graph.
def scatter_flat(to_cache: Any, kv_cache: Any, slot_mapping: Any) -> None:
    """``flat-view`` (0.17-0.21) with the slots clamped."""
    slots = slot_mapping.clamp_min(0)
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1]
    kv_cache.view(num_blocks * block_size, *kv_cache.shape[2:])[slots] = to_cache


def scatter_clamped(to_cache: Any, kv_cache: Any, slot_mapping: Any) -> None:
    """``2d-index`` (0.22-0.24) with the slots clamped; a strided view of the buffer
    (padded pages) keeps the 2-D index, the only form that addresses it."""
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


def apply(module: object, shape: str, hooks: Hooks) -> list[Replacement]:
    """Install the clamped scatter written for ``shape`` (a name from :data:`SHAPES`)."""
    return [wrap(module, ATTRIBUTE, _installed(REPLACEMENTS[shape]), PATCH_ID)]


# The gate for code of no tested build: the body must be one of these, statement by
# statement and operand by operand, whatever its variables are called.
PARAMS = ("to_cache", "kv_cache", "slot_mapping")
SHAPES = {
    "def f(rows, cache, slots):\n a, b, c, d = cache.shape\n"
    " flat = cache.view(a * b, c, d)\n flat[slots] = rows": "flat-view",
    "def f(rows, cache, slots):\n n = cache.shape[1]\n cache[slots // n, slots % n] = rows": (
        "2d-index"
    ),
}
# Upstream's fixed bodies (0.25; head-major from 0.29) and vendors' spellings of the clamp.
_STORE = "cache[slots // n, slots % n] = rows"
FIXED = {
    "upstream, 2-D": f"n = cache.shape[1]\n slots = slots.clamp_min(0)\n {_STORE}",
    "upstream, head-major": "n = cache.shape[2]\n slots = slots.clamp_min(0)\n"
    " cache[slots // n, :, slots % n] = rows",
    "clamp(min=0)": f"n = cache.shape[1]\n slots = slots.clamp(min=0)\n {_STORE}",
    "clamp first": f"slots = slots.clamp_min(0)\n n = cache.shape[1]\n {_STORE}",
    "torch.clamp": "s = torch.clamp(slots, min=0)\n n = cache.shape[1]\n"
    " cache[s // n, s % n] = rows",
    "in place": f"slots.clamp_min_(0)\n n = cache.shape[1]\n {_STORE}",
    "inline": "n = cache.shape[1]\n cache[slots.clamp_min(0) // n, slots.clamp_min(0) % n] = rows",
}


def _templates(bodies: dict[str, str], sig: str = "") -> dict[str, str]:
    return {template_of(sig + src): name for src, name in bodies.items()}


KNOWN = _templates(SHAPES)
KNOWN_FIXED = _templates({v: k for k, v in FIXED.items()}, "def f(rows, cache, slots):\n ")


def shape_check(tree: ast.Module) -> Probe:
    fn = top_level(tree, ATTRIBUTE)
    if not isinstance(fn, ast.FunctionDef):
        return Probe(None, detail=f"no function {ATTRIBUTE} in the module")
    body = body_template(fn)
    if params(fn) == PARAMS and body in KNOWN_FIXED:
        return Probe(None, fixed=True, detail=f"slots are clamped ({KNOWN_FIXED[body]})")
    return expect(
        KNOWN.get(body, ""),
        f"unclamped {KNOWN.get(body)} store",
        {
            f"parameters {PARAMS}": params(fn) == PARAMS and not fn.args.kwonlyargs,
            "one of the known stores (the body is none of the known stores): flat view of "
            "a [blocks, block_size, ...] cache (0.17-0.21), kv_cache[slot // bs, slot % bs] "
            "(0.22-0.24), or either clamped (upstream's fix)": body in KNOWN,
        },
    )


probe_tree, probe = probes(
    PATCH_ID, lambda tree: fingerprints(tree, (ATTRIBUTE,)), shape_check, (ATTRIBUTE,)
)


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    """The live ``basic_cache`` on scratch caches with padding: real rows land, padding
    goes to the null block only, nothing else changes; on CUDA also no host sync and
    CUDA-graph capture and replay."""
    fn = checks.live_scatter(module, ctx.version)
    results = checks.scatter_checks(fn, ctx.device, ctx.shape)
    if ctx.device == "cuda":
        results += checks.cuda_checks(fn)
    return results


def in_situ(connector: Any) -> dict[str, Any] | None:
    """The scatter check on a scratch copy of the buffer the worker just registered."""
    model = sys.modules.get(checks.MODEL_MODULE)
    if model is None:
        return None
    return checks.in_situ_scatter(model.basic_cache, getattr(connector, "_kv_cache", None))
