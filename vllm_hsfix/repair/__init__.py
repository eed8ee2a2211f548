"""``vllm-hsfix repair PATHS --model MODEL_DIR``: regenerate exactly the bad files
(:mod:`.command`)."""

from __future__ import annotations

from typing import Any


def add_parser(subparsers: Any) -> Any:
    """The subcommand, imported only when asked for: the engine process (``python -m
    vllm_hsfix.repair.engine``) then starts without its module imported twice."""
    from .command import add_parser as add

    return add(subparsers)
