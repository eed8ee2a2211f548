"""Reading a target's code without running it: :func:`fingerprint` (the same on Python
3.10-3.13) and :func:`body_template` (variables renamed by position).
"""

from __future__ import annotations

import ast
import copy
import hashlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Probe:
    """A look at a target's code: a known ``shape``, ``fixed`` upstream, or neither."""

    shape: str | None
    fixed: bool = False
    detail: str = ""
    fingerprints: dict[str, str] = field(default_factory=dict)


def parse(src: str) -> ast.Module | None:
    try:
        return ast.parse(src)
    except SyntaxError:
        return None


def module_tree(module: object) -> ast.Module | None:
    """The parsed source of a live module (None when its source cannot be read)."""
    try:
        src = inspect.getsource(module)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return None
    return parse(src)


def probe_file(path: str, probe_tree: Callable[[ast.Module], Probe]) -> Probe:
    """Run a source probe on a file without importing it (used by ``status``)."""
    try:
        with open(path, encoding="utf-8") as fh:
            tree = parse(fh.read())
    except OSError as exc:
        return Probe(None, detail=f"cannot read {path}: {exc}")
    if tree is None:
        return Probe(None, detail=f"{path} does not parse")
    return probe_tree(tree)


def _last(nodes: list[ast.stmt], kinds: tuple[type, ...], name: str) -> Any:
    """The last definition called ``name`` among ``nodes`` (the one Python keeps)."""
    found = None
    for node in nodes:
        if isinstance(node, kinds) and node.name == name:  # type: ignore[attr-defined]
            found = node
    return found


def top_level(tree: ast.Module, name: str) -> ast.FunctionDef | ast.ClassDef | None:
    return _last(tree.body, (ast.FunctionDef, ast.ClassDef), name)


def method(cls: ast.ClassDef | None, name: str) -> ast.FunctionDef | None:
    return _last(cls.body if cls else [], (ast.FunctionDef,), name)


def strip_docstrings(tree: ast.AST) -> ast.AST:
    tree = copy.deepcopy(tree)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(getattr(body[0], "value", None), ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return tree


# Fields that differ between Python versions for the same code (empty lists and None
# are left out too: 3.13's ``ast.dump`` drops them).
_UNSTABLE = frozenset({"ctx", "type_params", "kind", "type_comment"})


def canonical(node: object) -> str:
    """The code as a string that is the same on every supported Python version."""
    if isinstance(node, ast.AST):
        parts = []
        for name in node._fields:
            if name in _UNSTABLE:
                continue
            value = getattr(node, name, None)
            if value is None or value == []:
                continue
            parts.append(f"{name}={canonical(value)}")
        return f"{type(node).__name__}({','.join(parts)})"
    if isinstance(node, list):
        return "[" + ",".join(canonical(v) for v in node) + "]"
    return repr(node)


def fingerprint(node: ast.AST | None) -> str:
    """A short hash of a definition's code without docstrings, comments or formatting."""
    if node is None:
        return "absent"
    return hashlib.sha256(canonical(strip_docstrings(node)).encode()).hexdigest()[:16]


def body_template(fn: ast.FunctionDef) -> str:
    """``fn``'s statements with parameters renamed ``p0, ...`` and locals ``v0, ...`` in
    order of first assignment; equal templates do the same to the same operands."""
    fn = strip_docstrings(fn)  # type: ignore[assignment]
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)]
    rename = {name: f"p{i}" for i, name in enumerate(params)}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id not in rename:
            rename[node.id] = f"v{len(rename) - len(params)}"
    body = copy.deepcopy(fn.body)
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and node.id in rename:
                node.id = rename[node.id]
    return canonical(body)


def template_of(src: str) -> str:
    """The :func:`body_template` of the one function defined in ``src``."""
    tree = ast.parse(src.strip())
    fn = tree.body[0]
    assert isinstance(fn, ast.FunctionDef)
    return body_template(fn)


def attribute_chains(tree: ast.AST) -> set[str]:
    """Dotted names the code reads, e.g. ``{"kv_cache.shape", "self._block_size"}``."""
    found = (ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute))
    return {chain for chain in found if chain.replace(".", "").isidentifier()}


def assigned_attributes(tree: ast.AST) -> set[str]:
    """``self.X`` targets stored to anywhere in the code (any assignment or loop target)."""
    return {
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
    }
