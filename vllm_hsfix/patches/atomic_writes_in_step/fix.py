"""``atomic-writes-in-step``: on 0.17-0.21 a hidden-states file appears at its path
whole, or not at all (docs/patches.md). Goes when: 0.21.x is no longer supported.
"""

from __future__ import annotations

import ast
import contextlib
import os
from typing import Any

from ... import checks
from ...shapes import Probe, method
from .._connector_io import fsync, temp_path
from .._probe import calls, class_def, expect, fingerprints, params, probes
from .._wrap import Replacement, arg, wrap
from ..hooks import Hooks

PATCH_ID = "atomic-writes-in-step"
ATTRIBUTE = "ExampleHiddenStatesConnector"
SAVE = "save_kv_layer"


# The fix: the release writes each request of the step to a temporary name beside its
# file (its metadata's filename, for this call only); each file written is then fsynced
# and renamed into place, so a reader never sees a partial file at the final path.
def _publish(temps: list[str], finals: list[str]) -> None:
    done = [(t, f) for t, f in zip(temps, finals, strict=True) if os.path.exists(t)]
    for tmp, final in done:
        fsync(tmp)
        os.replace(tmp, final)
    for directory in {os.path.dirname(f) or "." for _, f in done}:
        with contextlib.suppress(OSError):  # some file systems cannot fsync a directory
            fsync(directory, directory=True)


def save_atomically(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    layer = arg(args, kwargs, 0, "layer_name")
    if layer not in getattr(instance, "cache_layers", (layer,)):  # the release saves nothing
        return wrapped(*args, **kwargs)  # for this layer: no temporary name to make
    requests = list(getattr(instance._get_connector_metadata(), "requests", None) or ())
    finals = [r.filename for r in requests]
    temps = [temp_path(f) for f in finals]
    try:
        for request, tmp in zip(requests, temps, strict=True):
            request.filename = tmp
        result = wrapped(*args, **kwargs)
        _publish(temps, finals)
        return result
    except BaseException:
        for tmp in temps:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise
    finally:
        for request, final in zip(requests, finals, strict=True):
            request.filename = final


def apply(module: Any, shape: str, hooks: Hooks) -> list[Replacement]:
    return [wrap(getattr(module, ATTRIBUTE), SAVE, save_atomically, PATCH_ID)]


# The gate for code of no tested build: save_kv_layer calls save_file on each request's
# metadata filename (0.22.0 on: a writer thread, atomic-writes' target).
SHAPE = "save-file-in-step"


def shape_check(tree: ast.Module) -> Probe:
    cls = class_def(tree, ATTRIBUTE)
    save = method(cls, SAVE)
    saves = [c for c in calls(save) if c.endswith("save_file")]
    if save is not None and not saves:
        return Probe(None, fixed=True, detail=f"{SAVE} writes no file itself")
    source = ast.unparse(save) if save is not None else ""
    wanted = {
        f"{ATTRIBUTE}.{SAVE}(self, layer_name, kv_layer, attn_metadata, **kwargs)": (
            params(save)[:4] == ("self", "layer_name", "kv_layer", "attn_metadata")
        ),
        f"{SAVE} saves each request of self._get_connector_metadata() at request.filename": (
            "self._get_connector_metadata()" in source and "request.filename" in source
        ),
    }
    return expect(SHAPE, "save_file at the final path inside the step", wanted)


probe_tree, probe = probes(
    PATCH_ID,
    lambda tree: fingerprints(tree, (SAVE,), ATTRIBUTE),
    shape_check,
    (f"{ATTRIBUTE}.{SAVE}",),
)


def check_rename(cls: type, directory: str) -> list[str]:
    """The LIVE save: a write that fails half-way leaves the older file whole, and no
    temporary file; a write that succeeds replaces it."""
    from types import SimpleNamespace

    final = os.path.join(directory, "r.safetensors")
    with open(final, "wb") as fh:
        fh.write(b"older")
    request = SimpleNamespace(filename=final)
    conn = cls.__new__(cls)
    conn._get_connector_metadata = lambda: SimpleNamespace(requests=[request])

    def torn(*args: Any, **kwargs: Any) -> None:
        with open(request.filename, "wb") as fh:
            fh.write(b"part")
        raise OSError("disk full")

    def whole(*args: Any, **kwargs: Any) -> None:
        with open(request.filename, "wb") as fh:
            fh.write(b"newer")

    problems = []
    with contextlib.suppress(OSError):
        save_atomically(torn, conn, ("hsfix-layer",), {})
    with open(final, "rb") as fh:
        if fh.read() != b"older" or request.filename != final:
            problems.append("a failed write changed the file at the final path")
    save_atomically(whole, conn, ("hsfix-layer",), {})
    with open(final, "rb") as fh:
        if fh.read() != b"newer":
            problems.append("a whole write did not replace the file")
    if sorted(os.listdir(directory)) != ["r.safetensors"]:
        problems.append(f"left behind: {sorted(os.listdir(directory))}")
    return problems


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    import tempfile

    name = f"{ATTRIBUTE}.{SAVE}: a file appears whole at its path, or not at all"
    if ctx.shape is None:  # 0.22.0 on: the writer thread, atomic-writes' row
        return [checks.result(name, [], skipped=f"vLLM {ctx.version}: not applied here")]
    with tempfile.TemporaryDirectory() as d:
        return checks.one(name, lambda: check_rename(getattr(module, ATTRIBUTE), d))
