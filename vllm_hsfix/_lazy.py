"""The only part of vllm-hsfix that runs at interpreter start: post-import hooks.

It imports only what every interpreter has loaded (``_thread``, ``os``, ``sys``; not
``typing``). A finder first on ``sys.meta_path`` wraps the loader of ``vllm`` (the
activation callback runs before vLLM's ``__init__``) and of hooked modules
(:func:`when_imported`, wrapt's ``register_post_import_hook`` contract); a spec lookup
fires nothing. What the ``vllm`` callback raises goes to :func:`errors`, not the import.
"""

import _thread
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType
    from typing import Any


class _ForkSafeRLock:
    """An ``RLock`` that a forked child gets back unlocked: a lock held by another
    thread at ``fork()`` would stay held forever there (vLLM and data loaders fork)."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._lock = _thread.RLock()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


# The package's one lock: the watcher's hooks here, the runtime's records (``state``).
LOCK = _ForkSafeRLock()
_SOURCES: list[str] = []
_ERRORS: list[str] = []
_callback: "Callable[[str], None] | None" = None
_searching: set[int] = set()  # threads inside our own find_spec
_HOOKS: "dict[str, list[Callable[[ModuleType], None]]]" = {}  # popped when they fire


def sources() -> list[str]:
    """Activation paths that fired in this process, in order (import, plugin, ...)."""
    return list(_SOURCES)


def errors() -> list[str]:
    """Exceptions the watcher swallowed so they could not break ``import vllm``."""
    return list(_ERRORS)


def record_source(source: str) -> None:
    with LOCK:
        if source not in _SOURCES:
            _SOURCES.append(source)


class _Loader:
    """The module's own loader: the ``vllm`` callback runs before ``exec_module``,
    the post-import hooks after it."""

    def __init__(self, loader: "Any") -> None:
        self._loader = loader

    def create_module(self, spec: "Any") -> "Any":
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: "ModuleType") -> None:
        module.__loader__ = self._loader  # no trace of the wrapper once it runs
        if getattr(module.__spec__, "loader", None) is self:
            module.__spec__.loader = self._loader
        if module.__name__ == "vllm":
            _fire()
        self._loader.exec_module(module)
        with LOCK:
            hooks = _HOOKS.pop(module.__name__, [])
        for hook in hooks:  # outside the lock: a hook may import, or start threads
            hook(module)

    def __getattr__(self, name: str) -> "Any":
        return getattr(self._loader, name)


class _Watcher:
    """A meta-path finder that finds nothing itself: it wraps the loader the other
    finders give for ``vllm`` (while a callback waits) and for hooked modules.
    It never leaves ``sys.meta_path`` (Python would skip the next finder)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> "Any":
        me = _thread.get_ident()
        wanted = (fullname == "vllm" and _callback is not None) or fullname in _HOOKS
        if me in _searching or not wanted:
            return None
        _searching.add(me)
        try:
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                spec = None if finder is self or find is None else find(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _Loader(spec.loader)
                    return spec
            return None
        except Exception as exc:
            _ERRORS.append(f"import watcher: {exc!r}")
            return None
        finally:
            _searching.discard(me)

    def __repr__(self) -> str:
        return "<vllm_hsfix import watcher>"


_WATCHER = _Watcher()


def _watch() -> None:
    if _WATCHER not in sys.meta_path:
        sys.meta_path.insert(0, _WATCHER)


def _fire() -> None:
    global _callback
    with LOCK:
        callback, _callback = _callback, None
    if callback is None:
        return
    try:
        callback("vllm-import")
    except Exception as exc:
        _ERRORS.append(f"activation on vllm import: {exc!r}")
        if os.environ.get("VLLM_HSFIX_STRICT", "").strip().lower() in {"1", "true", "yes", "on"}:
            raise


def activate(source: str, start: "Callable[[str], None]") -> None:
    """Record ``source``; run ``start(source)`` now if vLLM is imported, else
    ``start("vllm-import")`` when it is."""
    global _callback
    with LOCK:
        record_source(source)
        if "vllm" not in sys.modules:
            _callback = start
            _watch()
            return
    start(source)


def when_imported(name: str, hook: "Callable[[ModuleType], None]") -> None:
    """Call ``hook(module)`` once module ``name`` is imported: now if it is, else right
    after its body has run (once; a reload does not call it again). What the hook
    raises propagates to the import, as with wrapt's."""
    with LOCK:
        module = sys.modules.get(name)
        if module is None:
            _HOOKS.setdefault(name, []).append(hook)
            _watch()
    if module is not None:
        hook(module)
