"""The two gates every patch passes before it touches anything.

1. Release gate: the installed vLLM's release against the patch's declared range
   (``packaging`` specifiers; dev and local builds such as ``0.24.1.dev12+gabc`` or
   ``0.24.0+cpu`` compare by their release).
2. Shape gate: the target's code, read with ``inspect``/``ast``, must look like a
   shape the patch knows. A shape that already contains the fix means "upstream fix
   present" (leave alone); an unknown shape means "refused" (leave alone, warn).

Shapes are recognised by structure (which names, attributes and calls the code
uses), not by exact text, so a reformatted or re-commented release still matches;
the exact normalised fingerprint is recorded beside it so ``status`` can tell a
tested build from an untested one.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

APPLY = "apply"
FIXED = "upstream fix present"


@dataclass(frozen=True)
class Probe:
    """The outcome of looking at a target's code.

    ``shape`` names a known shape the patch can handle, ``fixed`` says the code
    already carries upstream's fix, and neither means the shape is unknown.
    """

    shape: str | None
    fixed: bool = False
    detail: str = ""
    fingerprints: dict[str, str] = field(default_factory=dict)

    @property
    def known(self) -> bool:
        return self.shape is not None or self.fixed


def in_release_range(version: Version, releases: str) -> bool:
    """Whether ``version`` falls in ``releases``.

    Lower bounds compare the X.Y.Z release only, so a pre-release, dev or local build
    of 0.24.0 (``0.24.0rc1``, ``0.24.1.dev12+gabc``, ``0.24.0+cu128``) belongs to the
    line its release does. Upper bounds compare the full public version, so a dev
    build of the fixed release (``0.25.0.dev3``) is still in range: the shape gate
    then decides from its code whether it already has the fix.
    """
    public = Version(version.public)
    release = Version(".".join(str(p) for p in version.release))
    for spec in SpecifierSet(releases):
        bound = Version(spec.version)
        op = spec.operator
        if op == ">=":
            ok = release >= bound
        elif op == ">":
            ok = release > bound
        elif op == "<":
            ok = public < bound
        elif op == "<=":
            ok = public <= bound
        else:
            ok = spec.contains(public, prereleases=True)
        if not ok:
            return False
    return True


def module_tree(module: object) -> ast.Module | None:
    """The parsed source of a live module (None when its source cannot be read)."""
    try:
        src = inspect.getsource(module)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return None
    return parse(src)


def parse(src: str) -> ast.Module | None:
    try:
        return ast.parse(src)
    except SyntaxError:
        return None


def top_level(tree: ast.Module, name: str) -> ast.FunctionDef | ast.ClassDef | None:
    """The last top-level ``def``/``class`` called ``name`` (the one Python keeps)."""
    found = None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            found = node
    return found


def method(cls: ast.ClassDef | None, name: str) -> ast.FunctionDef | None:
    if cls is None:
        return None
    found = None
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            found = node
    return found


def _strip_docstrings(tree: ast.AST) -> ast.AST:
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


def fingerprint(node: ast.AST | None) -> str:
    """A short hash of a definition's AST without docstrings, comments or formatting."""
    if node is None:
        return "absent"
    dumped = ast.dump(_strip_docstrings(node), include_attributes=False)
    return hashlib.sha256(dumped.encode()).hexdigest()[:16]


def attribute_chains(tree: ast.AST) -> set[str]:
    """Dotted names the code reads, e.g. ``{"kv_cache.shape", "self._block_size"}``."""
    chains: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts: list[str] = []
            cur: ast.AST = node
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name):
                parts.append(cur.id)
                chains.add(".".join(reversed(parts)))
    return chains


def names(tree: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)
    }


def assigned_attributes(tree: ast.AST) -> set[str]:
    """``self.X`` targets assigned anywhere in the code."""
    out: set[str] = set()
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                out.add(f"{t.value.id}.{t.attr}")
    return out


def probe_live(
    module: object,
    probe_tree: Callable[[ast.Module], Probe],
    live_objects: Callable[[object], dict[str, object]],
) -> Probe:
    """Run a source probe on a live module, then make sure the live objects still come
    from that source (not replaced by someone else's hot-fix)."""
    tree = module_tree(module)
    if tree is None:
        return Probe(None, detail="the module's source cannot be read (no .py file?)")
    result = probe_tree(tree)
    owner_file = getattr(module, "__file__", None)
    for label, obj in live_objects(module).items():
        problem = foreign_replacement_of(label, obj, owner_file)
        if problem:
            return Probe(None, detail=problem, fingerprints=result.fingerprints)
    return result


def foreign_replacement_of(label: str, obj: object, owner_file: str | None) -> str | None:
    from .patches._wrap import patch_id_of

    if obj is None:
        return f"{label} is missing from the live module"
    if patch_id_of(obj) is not None:
        obj = obj.__wrapped__  # type: ignore[attr-defined]
    code = getattr(obj, "__code__", None)
    if code is None or not owner_file:
        return None
    if os.path.realpath(code.co_filename) != os.path.realpath(owner_file):
        return (
            f"{label} was replaced by {getattr(obj, '__qualname__', obj)!r} from {code.co_filename}"
        )
    return None


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


@dataclass(frozen=True)
class Decision:
    """What the gates say about one patch: ``code`` as in ``state.CODES`` or "apply"."""

    code: str
    reason: str
    probe: Probe | None = None


def decide(
    patch: Any,
    version: str | None,
    problem: str | None,
    disabled: bool,
    probe: Callable[[], Probe],
    fixed_from: str,
) -> Decision:
    """Run both gates for one patch. ``probe`` is called only when the release is in range."""
    if disabled:
        return Decision(
            "disabled", "turned off by VLLM_HSFIX_DISABLE / VLLM_HSFIX_DISABLED_PATCHES"
        )
    if version is None:
        return Decision(
            "unknown-version",
            (problem or "vLLM version unknown")
            + "; not patching (set VLLM_HSFIX_VLLM_VERSION to the release it is)",
        )
    parsed = Version(version)
    if Version(parsed.public) >= Version(fixed_from):
        return Decision(
            "upstream-fix-present", f"upstream fix present: vLLM {version} >= {fixed_from}"
        )
    if not in_release_range(parsed, patch.releases):
        return Decision("not-needed", f"vLLM {version}: {patch.not_needed}")
    result = probe()
    if result.fixed:
        return Decision(
            "upstream-fix-present",
            f"upstream fix present: vLLM {version} code is fixed ({result.detail})",
            result,
        )
    if result.shape is None:
        return Decision(
            "unknown-shape",
            f"vLLM {version}: {patch.target} does not look like any known shape; "
            f"not patched ({result.detail})",
            result,
        )
    return Decision("apply", f"vLLM {version}: shape {result.shape}", result)
