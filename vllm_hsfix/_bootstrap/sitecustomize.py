"""Bootstrap for ``vllm-hsfix run``: heading ``PYTHONPATH``, it runs as ``sitecustomize``
in every Python process, runs the user's own one, then activates vllm-hsfix.
Nothing here may break the interpreter's start-up.
"""

import os
import sys

_HERE = os.path.dirname(os.path.realpath(__file__))


def _is_here(entry: str) -> bool:
    try:
        return os.path.realpath(entry or os.curdir) == _HERE
    except (OSError, ValueError):
        return False


def _report_user_error() -> None:
    import traceback

    sys.stderr.write("Error in sitecustomize (run by the vllm-hsfix bootstrap):\n")
    traceback.print_exc()


def _chain_user_sitecustomize() -> None:
    saved = list(sys.path)
    ours = sys.modules.pop("sitecustomize", None)
    try:
        sys.path[:] = [p for p in sys.path if not _is_here(p)]
        import importlib

        importlib.import_module("sitecustomize")
    except ImportError as exc:
        if exc.name != "sitecustomize":
            _report_user_error()
    except Exception:
        _report_user_error()
    finally:
        sys.path[:] = saved
        user = sys.modules.get("sitecustomize")
        if user is not None and user is not ours:
            sys.modules["vllm_hsfix_user_sitecustomize"] = user
        if ours is not None:
            sys.modules["sitecustomize"] = ours


def _activate() -> None:
    if os.environ.get("VLLM_HSFIX_BOOTSTRAP", "1") == "0":
        return
    if "vllm_hsfix" in sys.modules:
        from vllm_hsfix.activation import activate

        activate("bootstrap")
        return
    sys.modules["_vllm_hsfix_activating"] = "bootstrap"  # type: ignore[assignment]
    try:
        import vllm_hsfix  # noqa: F401  (importing activates, recorded as "bootstrap")
    except ImportError:
        # This interpreter has no vllm-hsfix (e.g. another virtualenv): nothing to do.
        pass
    finally:
        sys.modules.pop("_vllm_hsfix_activating", None)


_chain_user_sitecustomize()
_activate()
