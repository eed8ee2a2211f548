"""``vllm-hsfix audit PATH...``: find hidden-states files that a broken vLLM wrote.

The Python API (numpy only): :func:`check_file` ``(path) -> FileReport``, the per-file
checks on one file, and :func:`audit_paths`, the whole audit, dataset checks included.
"""

from __future__ import annotations

from typing import Any

from .command import add_parser

__all__ = ["add_parser", "audit_paths", "check_file"]


def __getattr__(name: str) -> Any:
    # The API lives in ``pipeline``; importing it here eagerly would be cheap, but the
    # subcommand registration must stay the only cost of ``import vllm_hsfix.audit``.
    if name in ("audit_paths", "check_file"):
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
