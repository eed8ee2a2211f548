"""A file's sha256, to tell whether a run rewrote it, and its safetensors header."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def header(p: Path) -> dict:
    raw = p.read_bytes()
    return json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
