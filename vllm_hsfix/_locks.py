"""Re-entrant locks that are fresh in a forked child.

A lock held by another thread at ``fork()`` stays held forever in the child (that
thread does not exist there). vLLM and training code fork (multiprocessing's fork
start method, data loaders) while a thread may be activating this package, so every
lock of the package is made here and replaced in the child by
``os.register_at_fork``: the child's activation starts from a clean lock, and the
records it inherited are consistent because they are only changed under the lock.
"""

from __future__ import annotations

import os
import threading
import weakref
from types import TracebackType


class ForkSafeRLock:
    """``threading.RLock`` that a forked child gets back unlocked."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        _ALL.add(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(
        self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._lock.release()

    def _reset_in_child(self) -> None:
        self._lock = threading.RLock()


_ALL: weakref.WeakSet[ForkSafeRLock] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lock in list(_ALL):
        lock._reset_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
