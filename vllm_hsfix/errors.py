"""The package's one exception type (no imports: ``import vllm_hsfix`` loads it)."""


class HsfixError(RuntimeError):
    """The fix cannot be put in place and the user asked to be told by an exception:
    strict mode (``VLLM_HSFIX_STRICT=1``), or an integrity path that fails closed."""
