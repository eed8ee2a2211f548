"""vLLM's ``vllm.general_plugins`` entry point, called in every vLLM process; it never
raises unless strict mode asks (vLLM does not catch it).
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
