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

from .. import checks
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
    clamped = clamped_store(fn)
    if clamped:
        return Probe(None, fixed=True, detail=f"slots are clamped ({clamped})", fingerprints=fps)
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


def _is_clamp_at_zero(node: ast.AST, clamped: set[str], slots: str) -> bool:
    """``node`` is a clamp of the slots (or of an already clamped name) at 0, however
    spelled: ``s.clamp_min(0)``, ``s.clamp(0)``, ``s.clamp(min=0)``,
    ``torch.clamp(s, min=0)``, ``torch.clamp_min(s, 0)``, ``s.clamp_min_(0)``."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    name = node.func.attr
    if name not in {"clamp", "clamp_min", "clamp_", "clamp_min_", "clip", "clip_"}:
        return False
    args = list(node.args)
    owner = node.func.value
    if isinstance(owner, ast.Name) and owner.id == "torch":
        if not args:
            return False
        owner, args = args[0], args[1:]
    if not (isinstance(owner, ast.Name) and owner.id in clamped | {slots}):
        return False
    low = args[0] if args else next((k.value for k in node.keywords if k.arg == "min"), None)
    return isinstance(low, ast.Constant) and low.value == 0


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def clamped_store(fn: ast.FunctionDef) -> str:
    """How the store is fed by a clamp of the slots ("" when it is not).

    Fixed code in any spelling: every name the store's index reads that carries slot
    values was bound to (or clamped in place from) a clamp at 0 of the slots, or the
    index clamps the slots inline, and the raw slot parameter itself is not read by
    the index. So a vendor build that clamps differently from upstream is left alone
    (never refused); a clamp whose result the store ignores is not a fix.
    """
    slots = fn.args.args[2].arg
    clamped: set[str] = set()
    derived: set[str] = set()  # names computed from slot values (clamped or not)
    raw_derived: set[str] = set()  # names computed from unclamped slots
    for stmt in fn.body:
        if isinstance(stmt, ast.Expr) and _is_clamp_at_zero(stmt.value, clamped, slots):
            func = stmt.value.func  # in place: s.clamp_min_(0)
            if isinstance(func, ast.Attribute) and func.attr.endswith("_"):
                owner = func.value
                if isinstance(owner, ast.Name):
                    clamped.add(owner.id)
                    if owner.id == slots:
                        slots = "\0"  # the parameter itself now holds clamped values
            continue
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target = stmt.targets[0]
            if isinstance(target, ast.Name):
                value = stmt.value
                if _is_clamp_at_zero(value, clamped, slots):
                    clamped.add(target.id)
                    raw_derived.discard(target.id)
                    if target.id == slots:
                        slots = "\0"  # the parameter's name now holds clamped values
                    continue
                reads = _names(value)
                if reads & (clamped | derived | raw_derived | {slots}):
                    unclamped = bool(reads & (raw_derived | {slots}))
                    (raw_derived if unclamped else derived).add(target.id)
                    clamped.discard(target.id)
                continue
            if isinstance(target, ast.Subscript):
                index = target.slice
                inline = any(_is_clamp_at_zero(n, clamped, slots) for n in ast.walk(index))
                raw = _names(index) & (raw_derived | {slots})
                if inline:
                    raw = {
                        n.id
                        for n in ast.walk(index)
                        if isinstance(n, ast.Name)
                        and n.id in raw_derived | {slots}
                        and not _inside_clamp(index, n, clamped, slots)
                    }
                fed = bool(_names(index) & (clamped | derived)) or inline
                if fed and not raw:
                    return "the store reads only clamped slots"
    return ""


def _inside_clamp(root: ast.AST, name: ast.Name, clamped: set[str], slots: str) -> bool:
    for node in ast.walk(root):
        if _is_clamp_at_zero(node, clamped, slots) and any(n is name for n in ast.walk(node)):
            return True
    return False


def live_objects(module: object) -> dict[str, object]:
    return {ATTRIBUTE: getattr(module, ATTRIBUTE, None)}


def probe(module: object) -> Probe:
    return probe_live(module, probe_tree, live_objects)


def apply(module: object, shape: str, hooks: Hooks) -> list[Replacement]:
    """Install the clamped scatter written for ``shape`` (a name from :data:`SHAPES`)."""
    return [wrap(module, ATTRIBUTE, _installed(REPLACEMENTS[shape]), PATCH_ID)]


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
    import sys

    model = sys.modules.get(checks.MODEL_MODULE)
    if model is None:
        return None
    return checks.in_situ_scatter(model.basic_cache, getattr(connector, "_kv_cache", None))
