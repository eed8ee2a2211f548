"""Opt-in provenance: hidden-states files say which fix made them.

With ``VLLM_HSFIX_PROVENANCE=1`` and a patch applied, the connector's module-level
``save_file`` (safetensors) is wrapped so every file it writes carries safetensors
metadata: the vllm-hsfix version, the vLLM version, the patches in force and the
in-situ check result. ``vllm-hsfix audit`` prints it, so a training pipeline can refuse
data made without the fix. Metadata the caller passes is kept; ours only adds keys
under the ``vllm_hsfix.`` prefix. Off by default: it changes the files' headers.
"""

from __future__ import annotations

from typing import Any

from .patches._wrap import Replacement, wrap

PATCH_ID = "provenance"
PREFIX = "vllm_hsfix."


def metadata() -> dict[str, str]:
    """The provenance keys for a file written now, in this process."""
    from . import __version__
    from .state import APPLIED, STATE

    inst = STATE.install
    applied = sorted(r.patch.id for r in STATE.records.values() if r.status == APPLIED)
    check = STATE.verify
    return {
        PREFIX + "version": __version__,
        PREFIX + "vllm": (inst.version or "unknown") if inst else "unknown",
        PREFIX + "patches": ",".join(applied) or "none",
        PREFIX + "in_situ_check": "not run"
        if check is None
        else ("passed" if check.get("ok") else "FAILED"),
    }


def _save_file(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if len(args) >= 3:
        user = dict(args[2] or {})
        args = (args[0], args[1], {**user, **metadata()}, *args[3:])
    else:
        kwargs = {**kwargs, "metadata": {**dict(kwargs.get("metadata") or {}), **metadata()}}
    return wrapped(*args, **kwargs)


def install(module: object) -> Replacement | None:
    """Wrap the connector module's ``save_file`` (None if it has none, or already done)."""
    if not callable(getattr(module, "save_file", None)):
        return None
    return wrap(module, "save_file", _save_file, PATCH_ID)
