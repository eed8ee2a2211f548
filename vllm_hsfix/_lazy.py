"""The only part of vllm-hsfix that runs at interpreter start.

``import vllm_hsfix`` (and the sitecustomize bootstrap) may run in every Python
process of an image, most of which never touch vLLM. So this module imports only what
every interpreter has loaded before ``site`` finishes (``_thread``, ``os``, ``sys``):
not even ``typing`` or ``__future__`` (``typing`` alone pulls ``re``, ``contextlib``,
``collections`` and more into every process). Annotations that name typing constructs
are therefore strings, resolved by type checkers only (``TYPE_CHECKING`` below is a
plain ``False``, which checkers treat as ``typing.TYPE_CHECKING``).
``tests/test_import_cost.py`` holds the list of modules the import may add.

It knows nothing of the rest of the package: it keeps the list of activation paths
that fired, and arms a ``sys.meta_path`` watcher that calls back (the callback is
given by the caller) when ``vllm`` is really imported. If vLLM is already imported,
the callback runs at once. The same watcher runs post-import hooks on named modules
(:func:`when_imported`), so the runtime needs no import-hook library until a target
module is really imported.

*Really* imported: ``importlib.util.find_spec("vllm")`` (what transformers, TRL and
accelerate call to test whether vLLM is available) also asks every meta-path finder.
So the watcher does not act when asked; it hands back the module's own spec with the
loader wrapped, and the callback runs when that loader executes the module, i.e. on
import. The ``vllm`` callback runs before vLLM's ``__init__`` does, so the post-import
hooks are in place for every vLLM module that import pulls in.

Nothing raised inside the watcher or the ``vllm`` callback reaches the user's
``import vllm``: it is recorded in :func:`errors` and the import goes on (post-import
hooks are the caller's: what they raise, the import raises, as with ``wrapt``'s). The
watcher never removes itself from ``sys.meta_path`` while the import system is
iterating over it (that would make Python skip the next finder); with nothing left to
watch it is a no-op.
"""

import _thread
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType
    from typing import Any

_LOCK = _thread.RLock()
_SOURCES: list[str] = []
_ERRORS: list[str] = []
_callback: "Callable[[str], None] | None" = None
_armed = False
_searching: set[int] = set()  # threads inside our own find_spec
# Post-import hooks by module name; popped when they fire (once, as wrapt's do).
_HOOKS: "dict[str, list[Callable[[ModuleType], None]]]" = {}


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
    """The module's own loader, with the ``vllm`` activation run before
    ``exec_module`` and the post-import hooks after it."""

    def __init__(self, loader: "Any") -> None:
        self._loader = loader

    def create_module(self, spec: "Any") -> "Any":
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: "ModuleType") -> None:
        # Leave no trace of the wrapper on the module once it is running.
        module.__loader__ = self._loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        if module.__name__ == "vllm":
            _fire()
        self._loader.exec_module(module)
        with _LOCK:
            hooks = _HOOKS.pop(module.__name__, [])
        for hook in hooks:  # outside the lock: a hook may import, or start threads
            hook(module)

    def __getattr__(self, name: str) -> "Any":
        return getattr(self._loader, name)


class _VllmImportWatcher:
    """Meta-path finder that finds nothing itself: it wraps the real loader of
    ``vllm`` (while armed) and of the modules that have post-import hooks."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> "Any":
        me = _thread.get_ident()
        if me in _searching or not ((fullname == "vllm" and _armed) or fullname in _HOOKS):
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


def _find_with_the_others(fullname: str, path: object, target: object) -> "Any":
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


def _install_watcher() -> None:
    """Put the watcher first on ``sys.meta_path`` (once; the caller holds the lock)."""
    if _WATCHER not in sys.meta_path:
        sys.meta_path.insert(0, _WATCHER)


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


def activate(source: str, start: "Callable[[str], None]") -> None:
    """Record ``source``; run ``start(source)`` now if vLLM is imported, else arm the
    watcher so ``start("vllm-import")`` runs when it is."""
    global _armed, _callback
    with _LOCK:
        record_source(source)
        if "vllm" not in sys.modules:
            _callback = start
            _install_watcher()
            _armed = True
            return
    start(source)


def when_imported(name: str, hook: "Callable[[ModuleType], None]") -> None:
    """Call ``hook(module)`` once module ``name`` has been imported: now if it already
    is, else right after its body has run (once; a later reload does not call it).

    The same contract as ``wrapt.register_post_import_hook``, without importing wrapt
    (4 ms, with its C extension) into every vLLM process: most never import a target.
    What the hook raises propagates to the import, as there.
    """
    with _LOCK:
        module = sys.modules.get(name)
        if module is None:
            _HOOKS.setdefault(name, []).append(hook)
            _install_watcher()
    if module is not None:  # outside the lock, as for a hook that fires on import
        hook(module)


def _after_fork_in_child() -> None:
    global _LOCK
    _LOCK = _thread.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)
