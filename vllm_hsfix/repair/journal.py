"""``repair --state FILE``: what is done, so an interrupted repair picks up where it stopped.

One JSON line per finished target, appended and flushed the moment the new file is in
place: ``{"path", "status": "replaced", "sha256", "size"}`` (``"status": "right"``: the
regenerated file agreed with the old one, which was kept). On a rerun a target whose
line says replaced or right and whose file still has that size and digest is done (not
regenerated, not counted again); a file changed since (someone wrote it again) is a
target like any other. A line cut short by a kill is ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import IO, Any


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Journal:
    def __init__(self, path: str) -> None:
        self.path = path
        self.done: dict[str, dict[str, Any]] = {}
        self._out: IO[str] | None = None
        try:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                        self.done[rec["path"]] = rec
                    except (ValueError, KeyError, TypeError):
                        continue
        except FileNotFoundError:
            pass

    def is_done(self, path: str) -> bool:
        """Replaced by an earlier run, and unchanged since."""
        rec = self.done.get(path)
        if not rec or rec.get("status") not in ("replaced", "right"):
            return False
        try:
            if os.path.getsize(path) != rec["size"]:
                return False
            return sha256(path) == rec["sha256"]
        except OSError:
            return False

    def count(self, status: str) -> int:
        return sum(1 for rec in self.done.values() if rec.get("status") == status)

    def replaced(self, path: str, digest: str, size: int, status: str = "replaced") -> None:
        """``status`` "right": the old file was kept (it agreed with the regenerated one)."""
        rec = {"path": path, "status": status, "sha256": digest, "size": size}
        self.done[path] = rec
        if self._out is None:
            self._out = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._out.write(json.dumps(rec) + "\n")
        self._out.flush()
        os.fsync(self._out.fileno())

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
