"""The readers' side of the connector's ``.lock`` protocol."""

from __future__ import annotations

import fcntl
import os


def held(path: str) -> bool:
    """A writer holds ``path``'s ``.lock`` (it must exist): a shared lock is refused."""
    with open(path + ".lock") as lf:
        try:
            fcntl.flock(lf, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False


def written(path: str) -> bool:
    """The file exists and its writer has released the ``.lock`` (the readers' protocol)."""
    return os.path.exists(path) and os.path.exists(path + ".lock") and not held(path)
