"""``scatter-clamp``: padding slots (``-1``) go to the null block, not into the last
slot of a live block (docs/patches.md). Goes when: 0.24.x is no longer supported.
"""

from __future__ import annotations

import ast
from typing import Any

from ...shapes import Probe, body_template, strip_docstrings, template_of, top_level
from .._probe import expect, fingerprints, params, probes
from .._wrap import Replacement, wrap
from ..hooks import Hooks
from .checks import in_situ, verify

__all__ = ["apply", "in_situ", "probe", "probe_tree", "shape_check", "verify"]

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


KNOWN = {template_of(src): name for src, name in SHAPES.items()}
_CLAMPS = {"clamp", "clamp_min", "clamp_", "clamp_min_"}


def _clamp_of(node: ast.AST) -> ast.expr | None:
    """The operand of a clamp at 0 (``x.clamp_min(0)``, ``x.clamp(min=0)``,
    ``torch.clamp(x, min=0)``, in place or not), else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    if node.func.attr not in _CLAMPS:
        return None
    is_fn = isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
    args = node.args if is_fn else [node.func.value, *node.args]
    low = [k.value for k in node.keywords if k.arg == "min"] or args[1:2]
    zero = bool(low) and isinstance(low[0], ast.Constant) and low[0].value == 0
    return args[0] if zero and args else None


def _reads(node: ast.AST, names: set[str], in_clamp: bool = False) -> bool:
    """Whether ``node`` reads ``names`` outside any clamp at 0 (``in_clamp`` False), or
    as the operand of one (True)."""
    operand = _clamp_of(node)
    if operand is not None:
        return in_clamp and (_reads(operand, names) or _reads(operand, names, True))
    if isinstance(node, ast.Name):
        return not in_clamp and node.id in names
    return any(_reads(child, names, in_clamp) for child in ast.iter_child_nodes(node))


def clamped_stores(fn: ast.FunctionDef) -> bool:
    """Whether every store into the cache is indexed by slots clamped at 0, never by the
    raw slots: what the code does, followed through its assignments in order."""
    raw, clean, stores = {params(fn)[2]}, set(), 0
    for stmt in strip_docstrings(fn).body:  # type: ignore[attr-defined]
        value = getattr(stmt, "value", None)
        if isinstance(stmt, ast.Expr) and isinstance(operand := _clamp_of(value), ast.Name):
            if value.func.attr.endswith("_"):  # type: ignore[union-attr]  # in place
                raw.discard(operand.id)
                clean.add(operand.id)
            continue
        if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
            return False  # a branch, a loop or anything else: not followed
        target, value = stmt.targets[0], stmt.value
        tainted = _reads(value, raw)
        fed = _reads(value, raw, True) or _reads(value, clean)
        if isinstance(target, ast.Name):
            (raw.add if tainted else raw.discard)(target.id)
            (clean.add if fed and not tainted else clean.discard)(target.id)
        elif isinstance(target, ast.Subscript):
            index = target.slice
            if _reads(index, raw) or not (_reads(index, raw, True) or _reads(index, clean)):
                return False
            stores += 1
    return stores > 0


def shape_check(tree: ast.Module) -> Probe:
    fn = top_level(tree, ATTRIBUTE)
    if not isinstance(fn, ast.FunctionDef):
        return Probe(None, detail=f"no function {ATTRIBUTE} in the module")
    body = body_template(fn)
    if params(fn) == PARAMS and clamped_stores(fn):
        return Probe(None, fixed=True, detail="slots are clamped at 0 before every store")
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
