"""vLLM's ``vllm.general_plugins`` entry point, called in every vLLM process.

Outside the ``vllm_hsfix`` package, because importing the package activates it: when
vLLM's plugin loader is what imports it, that activation is recorded as "plugin". Only
``HsfixError`` (strict mode) escapes: vLLM does not catch what a plugin raises.
"""

import sys

SOURCE = "_vllm_hsfix_activating"  # vllm_hsfix/__init__.py reads who imports it here


def register() -> None:
    """Activate vllm-hsfix as "plugin": import it, or, imported before, activate it."""
    imported = "vllm_hsfix" in sys.modules
    sys.modules[SOURCE] = "plugin"  # type: ignore[assignment]
    try:
        from vllm_hsfix.activation import activate
        from vllm_hsfix.errors import HsfixError
    finally:
        sys.modules.pop(SOURCE, None)
    if not imported:
        return  # the import activated it
    try:
        activate("plugin")
    except HsfixError:
        raise
    except Exception as exc:
        from vllm_hsfix.runtime import internal_error

        internal_error(f"vllm plugin activation failed: {exc!r}", exc)
