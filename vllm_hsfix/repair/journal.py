"""``repair --state FILE``: what is done, so an interrupted repair picks up where it stopped.

JSON Lines through :mod:`vllm_hsfix.audit.store`, one record per finished target,
appended and fsynced once its file is in place: ``{"path", "status": "replaced" |
"right", "sha256", "size"}``. A target whose file still has its record's size and
digest is done.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from ..audit import store


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class Journal:
    def __init__(self, path: str) -> None:
        self.path = path
        self.done: dict[str, dict[str, Any]] = {
            rec["path"]: rec for rec in store.read(path) if isinstance(rec.get("path"), str)
        }

    def is_done(self, path: str) -> bool:
        """Replaced (or found right) by an earlier run, and unchanged since."""
        rec = self.done.get(path)
        if not rec or rec.get("status") not in ("replaced", "right"):
            return False
        try:
            return os.path.getsize(path) == rec["size"] and sha256(path) == rec["sha256"]
        except OSError:
            return False

    def count(self, status: str) -> int:
        return sum(1 for rec in self.done.values() if rec.get("status") == status)

    def add(self, path: str, status: str, digest: str, size: int) -> None:
        rec = {"path": path, "status": status, "sha256": digest, "size": size}
        self.done[path] = rec
        store.append(self.path, rec, sync=True)
