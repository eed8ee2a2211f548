"""The only part of vllm-hsfix that runs at interpreter start.

``import vllm_hsfix`` (and the sitecustomize bootstrap) may run in every Python
process of an image, most of which never touch vLLM. So this module imports nothing
but builtins: it arms a tiny ``sys.meta_path`` watcher, and only when something
starts importing ``vllm`` does the real activation (wrapt, packaging, metadata,
version detection, post-import hooks on the targets) load. If vLLM is already
imported, activation runs at once.

The watcher never removes itself from ``sys.meta_path`` while the import system is
iterating over it (removing would make Python skip the next finder); once fired it is
a no-op that returns None.
"""

from __future__ import annotations

import _thread
import sys

_LOCK = _thread.RLock()
_SOURCES: list[str] = []
_armed = False


def sources() -> list[str]:
    """Activation paths that fired in this process, in order (import, plugin, ...)."""
    return list(_SOURCES)


class _VllmImportWatcher:
    """Meta-path finder that only observes: it never finds anything itself."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        global _armed
        if _armed and (fullname == "vllm" or fullname.startswith("vllm.")):
            with _LOCK:
                if not _armed:
                    return None
                _armed = False
            _start("vllm-import")
        return None

    # Tools that list meta-path finders print this.
    def __repr__(self) -> str:
        return "<vllm_hsfix import watcher>"


_WATCHER = _VllmImportWatcher()


def _start(trigger: str) -> None:
    from . import activation

    activation.start(trigger)


def activate(source: str) -> None:
    """Record an activation path and patch now or when vLLM is imported. Never raises
    unless strict mode asks for it (the strict check lives in ``activation``)."""
    global _armed
    with _LOCK:
        if source not in _SOURCES:
            _SOURCES.append(source)
        if "vllm" not in sys.modules:
            if not _armed and _WATCHER not in sys.meta_path:
                sys.meta_path.insert(0, _WATCHER)
            _armed = True
            return
    _start(source)
