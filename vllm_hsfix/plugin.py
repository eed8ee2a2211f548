"""vLLM's ``vllm.general_plugins`` entry point: installing the package is enough.

vLLM calls it once in every process it creates, before models and connectors exist,
and does not catch what it raises: it never raises unless strict mode asks.
"""

from .errors import HsfixError


def register() -> None:
    """Activate as "plugin"; only :class:`HsfixError` (strict mode) escapes."""
    try:
        from .activation import activate

        activate("plugin")
    except HsfixError:
        raise
    except Exception as exc:
        try:
            from .runtime import internal_error

            internal_error(f"vllm plugin activation failed: {exc!r}", exc)
        except HsfixError:
            raise
        except Exception:
            pass
