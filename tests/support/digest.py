"""A file's sha256, to tell whether a run rewrote it."""

from __future__ import annotations

import hashlib
from pathlib import Path


def digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()
