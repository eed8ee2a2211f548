"""The package's one exception type, at the bottom so every layer can raise it."""

from __future__ import annotations


class HsfixError(RuntimeError):
    """The fix cannot be put in place and the user asked to be told by an exception:
    strict mode (``VLLM_HSFIX_STRICT=1``), or an integrity path that fails closed."""
