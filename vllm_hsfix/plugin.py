"""vLLM ``vllm.general_plugins`` entry point.

vLLM calls every general plugin once per process it creates (the API/LLM process,
the engine core, each worker, the model-inspection subprocess), before the model and
the connectors exist. So installing vllm-hsfix into the vLLM environment is enough:
no code change in the user's script. vLLM does not catch exceptions raised inside a
plugin function; this one never raises unless strict mode asks for it, and it does
not touch CUDA.
"""

from __future__ import annotations

from .errors import HsfixError


def register() -> None:
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
