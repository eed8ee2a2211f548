"""The package's structure, read from its source: no import cycle, nothing imports upward,
no private name is used across modules, no module assigns another's globals. Every import
counts but a parent package's implicit one; the layers are ``docs/architecture.md``'s."""

from __future__ import annotations

import ast
from pathlib import Path

from vllm_hsfix.patches import PATCHES

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_hsfix"
ROOT = "vllm_hsfix"
# The patch modules are the table's: a new row's module takes its place here by itself.
PATCH_MODULES = {p.impl[len(ROOT) + 1 :] for p in PATCHES}
# Each unit's row (its package) and, where it has them apart, its checks.
UNIT_ROWS = {m.rsplit(".", 1)[0] for m in PATCH_MODULES}
UNIT_CHECKS = {
    f"{u}.checks" for u in UNIT_ROWS if (PACKAGE / u.replace(".", "/") / "checks.py").exists()
}

# Lowest first. A module may import only modules of a lower layer, or of its own
# subpackage group (audit.*, demo.*), which must then form no cycle among themselves.
LAYERS: list[set[str]] = [
    {"_version", "errors", "_lazy", "config", "releases", "codes", "patches.spec"},
    UNIT_ROWS,
    {"detect", "shapes", "patches", "patches.hooks"},
    {
        "patches._wrap",
        "patches._connector_io",
        "tested",
        "backends",
    },
    {"patches._probe", "provenance", "checks", "hazards", "observer"},
    UNIT_CHECKS,
    PATCH_MODULES,
    {"plan", "state", "audit"},
    {"views"},
    {"report"},
    {"runtime"},
    {"activation", "verify", "repair"},
    {"__init__", "cli"},
    {"__main__", "_bootstrap"},
]
GROUPS = ("audit", "repair", "_bootstrap")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "__init__"


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_package(name: str, mods: dict[str, Path]) -> bool:
    return mods[name].name == "__init__.py"


def resolve(current: str, mods: dict[str, Path], level: int, target: str | None) -> str:
    """The absolute in-package name of a (relative) import, "" for the package root."""
    base = [] if current == "__init__" else current.split(".")
    if not is_package(current, mods):
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, *(target.split(".") if target else [])])


def from_target(src: str, mods: dict[str, Path], node: ast.ImportFrom) -> str | None:
    """The in-package module a ``from ... import`` reads from ("" for the package root),
    or None when it reads from outside the package."""
    if node.level:
        return resolve(src, mods, node.level, node.module)
    if node.module and (node.module == ROOT or node.module.startswith(ROOT + ".")):
        return node.module[len(ROOT) + 1 :]
    return None


def imports_of(name: str, mods: dict[str, Path]) -> dict[str, set[str]]:
    """In-package modules ``name`` imports -> the names it takes from them."""
    tree = ast.parse(mods[name].read_text())
    found: dict[str, set[str]] = {}

    def add(target: str, what: str = "") -> None:
        key = target or "__init__"
        if key in mods:
            found.setdefault(key, set()).add(what)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == ROOT or alias.name.startswith(ROOT + "."):
                    add(alias.name[len(ROOT) + 1 :])
        elif isinstance(node, ast.ImportFrom):
            target = from_target(name, mods, node)
            if target is None:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                if sub in mods:
                    add(sub)  # ``from . import runtime``: the submodule itself
                else:
                    add(target, alias.name)
    found.pop(name, None)
    return found


def graph() -> dict[str, dict[str, set[str]]]:
    mods = modules()
    return {name: imports_of(name, mods) for name in mods}


def layer_of(name: str) -> int:
    for group in GROUPS:
        if name == group or name.startswith(group + "."):
            name = group
    for i, layer in enumerate(LAYERS):
        if name in layer:
            return i
    raise AssertionError(f"module {name} is in no layer of tests/unit/test_architecture.py")


def group_of(name: str) -> str | None:
    return next((g for g in GROUPS if name == g or name.startswith(g + ".")), None)


def test_every_module_has_a_layer() -> None:
    for name in modules():
        layer_of(name)


def test_no_import_cycle() -> None:
    edges = {k: set(v) for k, v in graph().items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)


def test_nothing_imports_upward() -> None:
    upward = []
    for src, targets in graph().items():
        for dst in targets:
            same_group = group_of(src) is not None and group_of(src) == group_of(dst)
            if not same_group and layer_of(dst) >= layer_of(src):
                upward.append(f"{src} (layer {layer_of(src)}) -> {dst} (layer {layer_of(dst)})")
    assert upward == []


def test_no_private_name_crosses_a_module_boundary() -> None:
    mods = modules()
    crossing = []
    for src, targets in graph().items():
        for dst, names in targets.items():
            crossing += [
                f"{src}: from {dst} import {n}"
                for n in names
                if n.startswith("_") and not n.startswith("__")
            ]
        tree = ast.parse(mods[src].read_text())
        aliases = _module_aliases(src, tree, mods)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                crossing.append(f"{src}: {node.value.id}.{node.attr}")
    assert crossing == []


def test_no_module_assigns_another_modules_globals() -> None:
    mods = modules()
    writes = []
    for src in mods:
        tree = ast.parse(mods[src].read_text())
        aliases = _module_aliases(src, tree, mods)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for t in targets:
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id in aliases
                ):
                    writes.append(f"{src}: {t.value.id}.{t.attr} = ...")
    assert writes == []


def _module_aliases(src: str, tree: ast.Module, mods: dict[str, Path]) -> set[str]:
    """Local names bound to in-package modules (``from . import runtime`` -> runtime)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = from_target(src, mods, node)
            if target is None:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                if sub in mods:
                    out.add(alias.asname or alias.name)
    return out


def test_the_graph_sees_function_level_imports() -> None:
    # Guards the test itself: runtime is imported only inside functions of activation.
    assert "runtime" in graph()["activation"]


def test_every_patch_unit_is_a_row_of_the_table() -> None:
    """A package under ``patches/`` is a patch unit (row, fix, optional checks), and must
    be declared in ``PATCHES``; its row names its ``fix`` module."""
    mods = modules()
    units = {m for m in mods if m.startswith("patches.") and is_package(m, mods)}
    assert units == UNIT_ROWS
    inside = {m for m in mods if m.rsplit(".", 1)[0] in units}
    assert inside == PATCH_MODULES | UNIT_CHECKS


# The hotfix core: what runs inside vLLM's processes plus ``status``, ``verify`` and ``run``.
# The data tools (``audit``, ``repair``) sit beside it, reached from the command line only.
DATA_TOOLS = ("audit", "repair")
FRONT = {"cli", "__main__"}


def test_the_core_imports_no_data_tool() -> None:
    g = graph()
    tools = {m for m in g if group_of(m) in DATA_TOOLS}
    core = set(g) - tools - FRONT
    assert {m: sorted(set(g[m]) & tools) for m in core if set(g[m]) & tools} == {}
    assert tools and "runtime" in core and "patches.aux_final_layer" in core
    assert not (PACKAGE / "demo").exists()


# Argument-parser tables: one add_argument after another, exempt from the length bound.
PARSER_TABLES = {"cli.build_parser", "audit.command.add_parser"}
MAX_FUNCTION, MAX_MODULE = 60, 500


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_a_hand_written_long_function_is_caught() -> None:
    # Guards the check below: a 61-line body counts as over.
    body = "def f():\n" + "    x = 1\n" * 60
    assert [n.name for n in long_functions(ast.parse(body))] == ["f"]


def long_functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (n.end_lineno or n.lineno) - n.lineno + 1 > MAX_FUNCTION
    ]


def test_no_function_is_over_60_lines() -> None:
    over = [
        f"{name}.{fn.name}: {(fn.end_lineno or 0) - fn.lineno + 1} lines"
        for name, path in modules().items()
        for fn in long_functions(ast.parse(path.read_text()))
        if f"{name}.{fn.name}" not in PARSER_TABLES
    ]
    assert over == []


def core_modules() -> dict[str, Path]:
    return {m: p for m, p in modules().items() if group_of(m) not in DATA_TOOLS}


def test_no_core_module_is_over_500_lines() -> None:
    over = {m: _lines(p) for m, p in core_modules().items() if _lines(p) > MAX_MODULE}
    assert over == {}
