"""The shape gate every patch shares: a tested build's fingerprints decide, else the
patch's shape check (written with these helpers), which fails closed naming what it
expected. ``docs/architecture.md`` says what each catches.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Callable

from .. import tested
from ..shapes import Probe, fingerprint, method, module_tree, top_level
from ._wrap import original_of


def definition(tree: ast.Module, name: str) -> ast.AST | None:
    """``Class.method`` or a top-level ``name`` (the last definition, as Python keeps)."""
    owner, _, member = name.rpartition(".")
    if not owner:
        return top_level(tree, name)
    return method(class_def(tree, owner), member)


def class_def(tree: ast.Module, name: str) -> ast.ClassDef | None:
    """The top-level class ``name`` (None when there is none)."""
    node = top_level(tree, name)
    return node if isinstance(node, ast.ClassDef) else None


def fingerprints(tree: ast.Module, names: tuple[str, ...], cls: str = "") -> dict[str, str]:
    """Fingerprints of ``names`` (methods of ``cls`` where it is given, else top-level)."""
    return {n: fingerprint(definition(tree, f"{cls}.{n}" if cls else n)) for n in names}


def gate(patch_id: str, fps: dict[str, str], check: Callable[[], Probe]) -> Probe:
    """The recorded answer of a tested build with these fingerprints, else ``check()``
    (also run for its message where the tested build's code is not a shape handled)."""
    known = tested.recorded(patch_id, fps)
    if known is not None and known[1] is not None:
        detail = f"the code of tested build {known[0]}"
        if known[1] == "fixed":
            return Probe(None, fixed=True, detail=detail, fingerprints=fps)
        return Probe(known[1], detail=detail, fingerprints=fps)
    got = check()
    if known is not None:
        detail = f"the code of tested build {known[0]}: {got.detail}"
        return Probe(None, detail=detail, fingerprints=fps)
    return Probe(got.shape, got.fixed, f"code of no tested build; {got.detail}", fps)


def expect(shape: str, detail: str, wanted: dict[str, bool]) -> Probe:
    """``shape`` when every expectation holds, else unknown, naming those that do not."""
    missing = [what for what, ok in wanted.items() if not ok]
    if missing:
        return Probe(None, detail="expected but not found: " + "; ".join(missing))
    return Probe(shape, detail=detail)


def params(fn: ast.AST | None) -> tuple[str, ...]:
    """A function's whole signature by name (``*args``, ``**kw`` marked; ``()`` for
    anything that is not a function)."""
    if not isinstance(fn, ast.FunctionDef):
        return ()
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args)]
    names += [f"*{a.vararg.arg}"] if a.vararg else []
    names += [x.arg for x in a.kwonlyargs]
    names += [f"**{a.kwarg.arg}"] if a.kwarg else []
    return tuple(names)


def calls(node: ast.AST | None) -> list[str]:
    """The functions ``node`` calls, as written (``save_file``, ``os.replace``, ...)."""
    if node is None:
        return []
    return [ast.unparse(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)]


def _matches(node: object, pattern: object) -> bool:
    if isinstance(pattern, ast.Name) and pattern.id == "_":
        return isinstance(node, ast.expr)
    if isinstance(pattern, list):
        return (
            isinstance(node, list)
            and len(node) == len(pattern)
            and all(_matches(n, p) for n, p in zip(node, pattern))  # noqa: B905
        )
    if not isinstance(pattern, ast.AST):
        return node == pattern
    if type(node) is not type(pattern):
        return False
    fields = [f for f in pattern._fields if f not in ("ctx", "kind", "type_comment")]
    return all(_matches(getattr(node, f, None), getattr(pattern, f, None)) for f in fields)


def finds(node: ast.AST | None, pattern: str) -> bool:
    """Whether ``node`` contains the expression ``pattern`` (``_`` matches any expression)."""
    if node is None:
        return False
    want = ast.parse(pattern, mode="eval").body
    return any(_matches(n, want) for n in ast.walk(node))


def _member(module: object, name: str) -> object:
    """What ``name`` (``attr`` or ``Class.attr``, from the class dict) is in ``module``."""
    owner, _, member = name.rpartition(".")
    if not owner:
        return getattr(module, name, None)
    obj = getattr(module, owner, None)
    return obj.__dict__.get(member) if isinstance(obj, type) else getattr(obj, member, None)


def probes(
    patch_id: str,
    fps: Callable[[ast.Module], dict[str, str]],
    shape_check: Callable[[ast.Module], Probe],
    own: tuple[str, ...] | Callable[[object], tuple[str, ...]],
) -> tuple[Callable[[ast.Module], Probe], Callable[[object], Probe]]:
    """A patch's ``probe_tree`` (its targets' fingerprints ``fps(tree)``, else
    ``shape_check``) and ``probe`` (the same on a live module whose objects named in
    ``own``, or ``own(module)``, are its source's own)."""

    def probe_tree(tree: ast.Module) -> Probe:
        return gate(patch_id, fps(tree), lambda: shape_check(tree))

    def probe(module: object) -> Probe:
        """The same on a live module's source, refused where a live object named in
        ``own`` is not that source's own definition (someone else's hot-fix)."""
        tree = module_tree(module)
        if tree is None:
            return Probe(None, detail="the module's source cannot be read (no .py file?)")
        result = probe_tree(tree)
        for name in own(module) if callable(own) else own:
            problem = foreign_replacement_of(
                name, _member(module, name), getattr(module, "__file__", None)
            )
            if problem:
                return Probe(None, detail=problem, fingerprints=result.fingerprints)
        return result

    return probe_tree, probe


def foreign_replacement_of(label: str, obj: object, owner_file: str | None) -> str | None:
    """Why ``obj`` is not the module's own definition (None when it is)."""
    if obj is None:
        return f"{label} is missing from the live module"
    obj = original_of(obj)
    code = getattr(obj, "__code__", None)
    if code is None or not owner_file:
        return None
    if os.path.realpath(code.co_filename) != os.path.realpath(owner_file):
        return (
            f"{label} was replaced by {getattr(obj, '__qualname__', obj)!r} from {code.co_filename}"
        )
    return None
