"""vLLM ``vllm.general_plugins`` entry point.

vLLM calls every general plugin once per process it creates (the API/LLM process,
the engine core, each worker, the model-inspection subprocess), before the model and
the connectors exist. So installing vllm-hsfix into the vLLM environment is enough:
no code change in the user's script. vLLM does not catch exceptions raised inside a
plugin function; this one never raises unless strict mode asks for it, and it does
not touch CUDA.

What it costs is paid in every one of those processes, most of which never import a
module vllm-hsfix patches: :func:`register` only records itself and starts the
runtime, which arms post-import hooks on the target modules and leaves detection,
the decision gates and the patches to the first target import
(``benchmarks/bench_startup.py`` measures it against a process without the plugin).
"""

from __future__ import annotations

from .errors import HsfixError


def register() -> None:
    """vLLM's hook: activate as "plugin". Never raises, except :class:`HsfixError` in
    strict mode."""
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
