"""Shape probes on live modules: the source probe, plus a check that the live objects
still come from that source (not replaced by someone else's hot-fix)."""

from __future__ import annotations

import ast
import os
from collections.abc import Callable

from ..shapes import Probe, module_tree
from ._wrap import original_of


def probe_live(
    module: object,
    probe_tree: Callable[[ast.Module], Probe],
    live_objects: Callable[[object], dict[str, object]],
) -> Probe:
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
