"""The hazard register: known ways a pinned vLLM loses or corrupts hidden states on the
extraction path, and what vllm-hsfix does about each (``patch``, ``refuse-config`` or
``documented``). Nothing here imports vLLM or the rest of the core.
"""

from __future__ import annotations

from ..codes import IN_PLACE, Code
from .model import (
    ACTIONS,
    CHECKED,
    DATA,
    DOCUMENTED,
    EXPOSED,
    FIXED_UPSTREAM,
    NOT_AFFECTED,
    OPEN,
    PATCH,
    PATCHED,
    PROCESS,
    REFUSE_CONFIG,
    UNKNOWN,
    Hazard,
    key,
)
from .register import HAZARDS

__all__ = [
    "ACTIONS", "CHECKED", "DATA", "DOCUMENTED", "EXPOSED", "FIXED_UPSTREAM", "HAZARDS",
    "HAZARD_IDS", "NOT_AFFECTED", "OPEN", "PATCH", "PATCHED", "PROCESS", "REFUSE_CONFIG",
    "UNKNOWN", "Hazard", "assess", "assess_all", "by_id", "refuse_config",
]  # fmt: skip

HAZARD_IDS: tuple[str, ...] = tuple(h.id for h in HAZARDS)


def by_id(hazard_id: str) -> Hazard:
    for h in HAZARDS:
        if h.id == hazard_id:
            return h
    raise KeyError(f"unknown hazard id {hazard_id!r}; known: {list(HAZARD_IDS)}")


def _state(
    hazard: Hazard, version: str, patch_codes: dict[str, str], active: bool
) -> tuple[str, str]:
    """(state, reason) of an affected or unaffected release (see :func:`assess`)."""
    if not hazard.affects(version):
        if hazard.fixed_in is not None and key(version) >= key(hazard.fixed_in):
            return FIXED_UPSTREAM, f"fixed in {hazard.fixed_in}"
        return NOT_AFFECTED, f"vLLM {version} is not {hazard.releases}"
    if hazard.action == PATCH:
        code = patch_codes.get(hazard.patch, "missing")
        if code == Code.NOT_NEEDED:  # its patch's target is not affected here
            return NOT_AFFECTED, f"patch {hazard.patch}: {code}"
        if code in IN_PLACE:
            return PATCHED, f"patch {hazard.patch}: {code}"
        return OPEN, f"patch {hazard.patch} is {code}"
    if hazard.action == REFUSE_CONFIG:
        if not active:  # VLLM_HSFIX_DISABLE=1 turns the check off with everything else
            return EXPOSED, f"vllm-hsfix is off; {hazard.setting}"
        return (
            CHECKED,
            f"a WARNING at engine start (strict: start-up fails) unless {hazard.setting}",
        )
    return EXPOSED, hazard.workaround or hazard.why_action


def assess(
    hazard: Hazard, version: str | None, patch_codes: dict[str, str], active: bool = True
) -> dict[str, str]:
    """One hazard's state on ``version`` (None: unknown), given each patch's ``status``
    code; ``open`` (its patch not in place) is the only state of vllm-hsfix's making."""
    out = {
        "action": hazard.action,
        "releases": hazard.releases,
        "loses": hazard.loses,
        "upstream": hazard.upstream,
    }
    if hazard.models:
        out["models"] = hazard.models
    if version is None:
        return {**out, "state": UNKNOWN, "reason": "the installed vLLM release is unknown"}
    try:
        state, reason = _state(hazard, version, patch_codes, active)
    except ValueError:
        state, reason = UNKNOWN, f"unreadable version {version!r}"
    return {**out, "state": state, "reason": reason}


def assess_all(
    version: str | None, patch_codes: dict[str, str], active: bool = True
) -> dict[str, dict[str, str]]:
    return {h.id: assess(h, version, patch_codes, active) for h in HAZARDS}


def refuse_config(version: str | None) -> tuple[Hazard, ...]:
    """The ``refuse-config`` rows of release ``version`` (none on an unreadable one)."""
    try:
        return tuple(h for h in HAZARDS if h.action == REFUSE_CONFIG and h.affects(version or ""))
    except ValueError:
        return ()
