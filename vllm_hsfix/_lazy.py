"""The only part of vllm-hsfix that runs at interpreter start.

``import vllm_hsfix`` (and the sitecustomize bootstrap) may run in every Python
process of an image, most of which never touch vLLM. So this module imports nothing
but builtins and knows nothing of the rest of the package: it keeps the list of
activation paths that fired, and arms a ``sys.meta_path`` watcher that calls back
(the callback is given by the caller) when ``vllm`` is really imported. If vLLM is
already imported, the callback runs at once.

*Really* imported: ``importlib.util.find_spec("vllm")`` (what transformers, TRL and
accelerate call to test whether vLLM is available) also asks every meta-path finder.
So the watcher does not act when asked; it hands back vLLM's own spec with the loader
wrapped, and the callback runs when that loader executes the module, i.e. on import.
It runs before vLLM's ``__init__`` does, so the post-import hooks are in place for
every vLLM module that import pulls in.

Nothing raised inside the watcher or the callback reaches the user's ``import vllm``:
it is recorded in :func:`errors` and the import goes on. The watcher never removes
itself from ``sys.meta_path`` while the import system is iterating over it (that
would make Python skip the next finder); once fired it is a no-op.
"""

from __future__ import annotations

import _thread
import os
import sys
from collections.abc import Callable
from typing import Any

_LOCK = _thread.RLock()
_SOURCES: list[str] = []
_ERRORS: list[str] = []
_callback: Callable[[str], None] | None = None
_armed = False
_searching: set[int] = set()  # threads inside our own find_spec


def sources() -> list[str]:
    """Activation paths that fired in this process, in order (import, plugin, ...)."""
    return list(_SOURCES)


def errors() -> list[str]:
    """Exceptions the watcher swallowed so they could not break ``import vllm``."""
    return list(_ERRORS)


def record_source(source: str) -> None:
    with _LOCK:
        if source not in _SOURCES:
            _SOURCES.append(source)


class _ActivatingLoader:
    """vLLM's own loader, with the activation callback run first in ``exec_module``."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: Any) -> None:
        # Leave no trace of the wrapper on the module once it is running.
        module.__loader__ = self._loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        _fire()
        self._loader.exec_module(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _VllmImportWatcher:
    """Meta-path finder that finds nothing itself: it wraps vLLM's loader."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> Any:
        me = _thread.get_ident()
        if fullname != "vllm" or not _armed or me in _searching:
            return None
        try:
            _searching.add(me)
            try:
                spec = _find_with_the_others(fullname, path, target)
            finally:
                _searching.discard(me)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            spec.loader = _ActivatingLoader(spec.loader)
            return spec
        except Exception as exc:
            _ERRORS.append(f"import watcher: {exc!r}")
            return None

    # Tools that list meta-path finders print this.
    def __repr__(self) -> str:
        return "<vllm_hsfix import watcher>"


def _find_with_the_others(fullname: str, path: object, target: object) -> Any:
    for finder in list(sys.meta_path):
        if finder is _WATCHER:
            continue
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        spec = find(fullname, path, target)
        if spec is not None:
            return spec
    return None


_WATCHER = _VllmImportWatcher()


def _fire() -> None:
    global _armed
    with _LOCK:
        if not _armed:
            return
        _armed = False
        callback = _callback
    if callback is None:
        return
    try:
        callback("vllm-import")
    except Exception as exc:
        _ERRORS.append(f"activation on vllm import: {exc!r}")
        if os.environ.get("VLLM_HSFIX_STRICT", "").strip().lower() in {"1", "true", "yes", "on"}:
            raise


def activate(source: str, start: Callable[[str], None]) -> None:
    """Record ``source``; run ``start(source)`` now if vLLM is imported, else arm the
    watcher so ``start("vllm-import")`` runs when it is."""
    global _armed, _callback
    with _LOCK:
        record_source(source)
        if "vllm" not in sys.modules:
            _callback = start
            if _WATCHER not in sys.meta_path:
                sys.meta_path.insert(0, _WATCHER)
            _armed = True
            return
    start(source)


def _after_fork_in_child() -> None:
    global _LOCK
    _LOCK = _thread.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)
