"""What a reader finds after a writer was killed mid-write (the torn-files children)."""

from __future__ import annotations

import os
from typing import Any


def found(final: str, old: dict[str, Any], status: int, work: str) -> dict[str, Any]:
    """How the writer ended, the file at ``final`` (``old``'s, another, or unloadable)
    and the hidden temporary files left in ``work``."""
    import torch
    from safetensors.torch import load_file

    try:
        got = load_file(final)
        content = "old" if torch.equal(got["token_ids"], old["token_ids"]) else "other"
    except Exception as exc:
        content = "unloadable: " + type(exc).__name__
    return {
        "killed_by": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "size": os.path.getsize(final),
        "content": content,
        "leftovers": sorted(n for n in os.listdir(work) if n.startswith(".")),
    }
