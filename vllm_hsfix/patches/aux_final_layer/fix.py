"""``aux-final-layer``: an aux id equal to ``num_hidden_layers`` gets the final layer's
output (docs/patches.md). Upstream's one statement, inserted into the release's own
``forward`` and installed as a plain function (``torch.compile(fullgraph=True)``
cannot trace a wrapper), named after the patch so compile caches keep graphs apart.
"""

from __future__ import annotations

import ast
import linecache
from types import SimpleNamespace
from typing import Any

from ... import checks
from ...shapes import Probe, method
from .._probe import class_def, expect, fingerprints, probes
from .._wrap import FunctionSwap, swap
from ..hooks import Hooks

PATCH_ID = "aux-final-layer"
CLASS, METHOD = "DeepseekV2Model", "forward"
AUX = "aux_hidden_state_layers"
FIX = "if self.end_layer in self.{aux}:\n    {states}.append({hidden} + {residual})\n"


def fixed_tree(fn: ast.FunctionDef, names: dict[str, Any]) -> ast.Module:
    """``fn`` with upstream's capture inserted just before the final norm."""
    fix = ast.parse(FIX.format(aux=AUX, **names)).body
    body = list(fn.body)
    at = body.index(names["norm"])
    for stmt in fix:
        for node in ast.walk(stmt):
            ast.copy_location(node, names["norm"])
    new = ast.FunctionDef(
        name=fn.name,
        args=fn.args,
        body=body[:at] + fix + body[at:],
        decorator_list=[],
        returns=fn.returns,
        type_comment=None,
        **({"type_params": []} if "type_params" in ast.FunctionDef._fields else {}),
    )
    ast.copy_location(new, fn)
    return ast.fix_missing_locations(ast.Module(body=[new], type_ignores=[]))


def build(original: Any, tree: ast.Module, filename: str) -> Any:
    """The fixed ``forward``: compiled from the release's own source with the capture,
    in the release module's globals, with the original's defaults and metadata."""
    import functools
    import types

    fn = method(class_def(tree, CLASS), METHOD)
    names = _shape(fn)
    assert fn is not None and names is not None  # the gate passed before apply
    label = f"{filename} (vllm-hsfix {PATCH_ID})"
    code = compile(fixed_tree(fn, names), label, "exec")
    lines = linecache.getlines(filename)  # tracebacks show the release's own lines
    if lines:
        linecache.cache[label] = (sum(map(len, lines)), None, lines, label)
    fcode = next(c for c in code.co_consts if isinstance(c, types.CodeType))
    new = types.FunctionType(fcode, original.__globals__, original.__name__, original.__defaults__)
    new.__kwdefaults__ = original.__kwdefaults__
    functools.update_wrapper(new, original)
    new.__qualname__ = f"{original.__qualname__} (vllm-hsfix {PATCH_ID})"
    return new


# The gate for code of no tested build: the release's forward must be the one this
# fix is written for (apply reads the same names from it).
def _is_aux_test(test: ast.AST, left: type) -> bool:
    """``<left> in self.aux_hidden_state_layers``."""
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, left)
        and [type(o) for o in test.ops] == [ast.In]
        and ast.unparse(test.comparators[0]) == f"self.{AUX}"
    )


def _loop_capture(loop: ast.For) -> dict[str, str] | None:
    """The names in the loop's ``if idx in self.aux...: A.append(H + R)``."""
    for stmt in loop.body:
        if isinstance(stmt, ast.If) and _is_aux_test(stmt.test, ast.Name) and stmt.body:
            call = stmt.body[0]
            src = ast.unparse(call)
            head, _, rest = src.partition(".append(")
            left, _, right = rest.rstrip(")").partition(" + ")
            if len(stmt.body) == 1 and all(n.isidentifier() for n in (head, left, right)):
                return {"states": head, "hidden": left, "residual": right}
    return None


def _shape(fn: ast.FunctionDef | None) -> dict[str, Any] | None:
    """The loop's names and the final-norm statement, when ``fn`` is a known forward."""
    if fn is None:
        return None
    loops = [s for s in fn.body if isinstance(s, ast.For)]
    names = _loop_capture(loops[-1]) if loops else None
    if names is None:
        return None
    norm = _dump(f"{names['hidden']}, _ = self.norm({names['hidden']}, {names['residual']})")
    after = fn.body[fn.body.index(loops[-1]) + 1 :]
    stmts = [s for s in after if ast.dump(s) == norm]
    if len(stmts) != 1:
        return None
    between = after[: after.index(stmts[0])]
    if not all(isinstance(s, ast.If) and isinstance(s.body[-1], ast.Return) for s in between):
        return None
    returned = _dump(f"return {names['hidden']}, {names['states']}")
    if not any(ast.dump(n) == returned for s in after for n in ast.walk(s)):
        return None
    return {**names, "norm": stmts[0]}


def _dump(statement: str) -> str:
    """A statement's structure, to compare with the release's whatever Python prints."""
    return ast.dump(ast.parse(statement).body[0])


def _captures_final(fn: ast.FunctionDef) -> bool:
    """Upstream's fix in any spelling: after the layer loop, a test of some id against
    ``self.aux_hidden_state_layers``, or the ``_maybe_add_hidden_state`` mixin."""
    loops = [i for i, s in enumerate(fn.body) if isinstance(s, ast.For)]
    after = fn.body[loops[-1] + 1 :] if loops else []
    if any(isinstance(s, ast.If) and _is_aux_test(s.test, ast.AST) for s in after):
        return True
    return "_maybe_add_hidden_state" in ast.unparse(fn)


def shape_check(tree: ast.Module) -> Probe:
    """0.18-0.24's forward (capture before each layer only), or the fixed one."""
    fn = method(class_def(tree, CLASS), METHOD)
    if fn is None:
        return Probe(None, detail=f"no method {CLASS}.{METHOD} in the module")
    if _captures_final(fn):
        return Probe(None, fixed=True, detail="the final layer's output is captured")
    if f"self.{AUX}" not in ast.unparse(fn):
        return Probe(None, detail=f"{CLASS}.{METHOD} captures no aux states")
    class_cell = any(
        isinstance(n, ast.Name) and n.id in ("super", "__class__") for n in ast.walk(fn)
    )
    return expect(
        "pre-norm-capture",
        "aux states at layer inputs only",
        {
            "an undecorated forward with `if idx in self.aux_hidden_state_layers: "
            "A.append(H + R)` in its last loop, then only early returns, then "
            "`H, _ = self.norm(H, R)` and `return H, A`": not fn.decorator_list
            and not class_cell
            and _shape(fn) is not None,
        },
    )


TARGET = f"{CLASS}.{METHOD}"
probe_tree, probe = probes(
    PATCH_ID, lambda tree: fingerprints(tree, (TARGET,)), shape_check, (TARGET,)
)


def apply(module: Any, shape: str, hooks: Hooks) -> list[FunctionSwap]:
    """Install the forward with upstream's capture (``shape``: ``pre-norm-capture``)."""
    from ...shapes import module_tree

    tree = module_tree(module)
    assert tree is not None
    cls = getattr(module, CLASS)
    return [swap(cls, METHOD, lambda f: build(f, tree, module.__file__), PATCH_ID)]


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    """The live ``forward`` on a small stand-in model (plain layers, one pipeline rank):
    every aux id gets its own state, id ``num_layers`` the last layer's output."""
    name = f"{CLASS}.{METHOD} returns one state per aux id, the final layer's included"
    return checks.one(name, lambda: check_aux_capture(getattr(module, CLASS)))


def check_aux_capture(model_cls: type, num_layers: int = 4) -> list[str]:
    """Call the live ``DeepseekV2Model.forward`` on a small stand-in model (one pipeline
    rank) asking for aux ids ``1, 2, num_layers``: each must be its own layer's state
    (the input of layers 1 and 2, the last layer's output before the norm)."""
    import types

    import torch

    forward = model_cls.__dict__["forward"]
    rank = SimpleNamespace(is_first_rank=True, is_last_rank=True)
    glb = {**forward.__globals__, "get_pp_group": lambda: rank}
    fn = types.FunctionType(forward.__code__, glb, "forward", forward.__defaults__)

    def layer(i: int) -> Any:
        def run(positions: Any, h: Any, r: Any, *rest: Any, **kw: Any) -> Any:
            r = h if r is None else h + r
            return r * 0.5 + (i + 1), r

        run.use_sequence_parallel_moe = False  # type: ignore[attr-defined]
        return run

    layers = [layer(i) for i in range(num_layers)]
    ids = torch.arange(3)
    model = SimpleNamespace(
        config=SimpleNamespace(),
        layers=layers,
        start_layer=0,
        end_layer=num_layers,
        aux_hidden_state_layers=(1, 2, num_layers),
        hidden_size=1,
        embed_input_ids=lambda x: x.float()[:, None],
        norm=lambda h, r: (h + r, h + r),
    )
    out = fn(model, ids, ids, None)
    h, r, want = ids.float()[:, None], None, []
    for i, f in enumerate(layers):
        if i in (1, 2):
            want.append(h + r)
        h, r = f(ids, h, r)
    want.append(h + r)
    got = out[1] if isinstance(out, tuple) else []
    if len(got) != len(want):
        return [f"{len(got)} aux states for {len(want)} ids"]
    return [
        f"aux slot {k} is not its layer's state"
        for k, (g, w) in enumerate(zip(got, want, strict=True))
        if not torch.equal(g, w)
    ]
