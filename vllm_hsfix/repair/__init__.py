"""``vllm-hsfix repair PATHS --model MODEL_DIR``: regenerate exactly the bad files."""

from typing import Any


def add_parser(subparsers: Any) -> Any:
    """The subcommand, imported only when asked for (the engine process imports less)."""
    from .command import add_parser as add

    return add(subparsers)
