"""THE hazard register: the known ways a pinned vLLM loses or corrupts hidden-state data,
or dies writing it, on the extraction path, and what vllm-hsfix does about each.

The patch table (``patches``) says what is changed; this register says why a user of a
release should care, and stays honest where nothing is changed. One row per hazard:
the releases affected (read from each release's own files, ``evidence``), the
trigger, what goes wrong and where (``loses``: the process or the data), upstream's
issue or pull request and first fixed release, and the action:

* ``patch``: a backport, gated by release and code shape like every patch; the row
  names the patch id (its range is the patch row's, checked by the tests);
* ``refuse-config``: the trigger is a setting; at engine start (when the scheduler's
  connector is built) the affected releases log one WARNING naming the setting to
  change (``setting``), and strict mode fails start-up (``refuse_config`` does it);
* ``documented``: nothing better is possible or built yet; ``why_action`` says which,
  and ``workaround`` what a user can do.

``evidence`` cites files of the release's wheel by line; ``CONN`` there stands for
``vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py``,
``GDN`` for ``vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py``.
``measured`` says what was run here and what it showed, or why nothing was.
:func:`assess` gives one row's state on a release for ``status``, :func:`refuse_config`
the rows whose settings are checked at engine start on a release; nothing here imports
vLLM or the rest of the package.
"""

from __future__ import annotations

from ..codes import Code
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
    PATCH_IN_PLACE,
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
    "HAZARD_IDS", "NOT_AFFECTED", "OPEN", "PATCH", "PATCHED", "PATCH_IN_PLACE", "PROCESS",
    "REFUSE_CONFIG", "UNKNOWN", "Hazard", "assess", "assess_all", "by_id", "refuse_config",
]  # fmt: skip

HAZARD_IDS: tuple[str, ...] = tuple(h.id for h in HAZARDS)


def by_id(hazard_id: str) -> Hazard:
    for h in HAZARDS:
        if h.id == hazard_id:
            return h
    raise KeyError(f"unknown hazard id {hazard_id!r}; known: {list(HAZARD_IDS)}")


def assess(
    hazard: Hazard, version: str | None, patch_codes: dict[str, str], active: bool = True
) -> dict[str, str]:
    """One hazard's state on release ``version`` (None: unknown), given the decision
    code of each patch (``patch_codes``, as ``status`` reports them) and whether
    vllm-hsfix is on at all (``active``: not ``VLLM_HSFIX_DISABLE=1``).

    ``not-affected`` (release outside the range), ``fixed-upstream`` (at or above
    ``fixed_in``), ``patched`` (its patch will be or is in place), ``checked-at-start``
    (a ``refuse-config`` row: its setting is checked when the engine starts),
    ``open`` (its patch will not be: refused, disabled, failed), ``exposed`` (affected
    and only documented, or a check that will not run: the ``workaround`` is the
    user's), ``unknown`` (no readable release)."""
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
        affected = hazard.affects(version)
    except ValueError:
        return {**out, "state": UNKNOWN, "reason": f"unreadable version {version!r}"}
    if not affected:
        fixed = hazard.fixed_in is not None and key(version) >= key(hazard.fixed_in)
        if fixed:
            return {**out, "state": FIXED_UPSTREAM, "reason": f"fixed in {hazard.fixed_in}"}
        return {**out, "state": NOT_AFFECTED, "reason": f"vLLM {version} is not {hazard.releases}"}
    if hazard.action == PATCH:
        code = patch_codes.get(hazard.patch, "missing")
        if code == Code.NOT_NEEDED.word:  # its patch's target is not affected here
            return {**out, "state": NOT_AFFECTED, "reason": f"patch {hazard.patch}: {code}"}
        if code in PATCH_IN_PLACE:
            return {**out, "state": PATCHED, "reason": f"patch {hazard.patch}: {code}"}
        return {**out, "state": OPEN, "reason": f"patch {hazard.patch} is {code}"}
    if hazard.action == REFUSE_CONFIG:
        # The check runs wherever vllm-hsfix is active (VLLM_HSFIX_DISABLE=1 turns it
        # off with everything else); what it finds is known only at engine start.
        if not active:
            return {**out, "state": EXPOSED, "reason": f"vllm-hsfix is off; {hazard.setting}"}
        return {
            **out,
            "state": CHECKED,
            "reason": f"a WARNING at engine start (strict: start-up fails) unless {hazard.setting}",
        }
    return {**out, "state": EXPOSED, "reason": hazard.workaround or hazard.why_action}


def assess_all(
    version: str | None, patch_codes: dict[str, str], active: bool = True
) -> dict[str, dict[str, str]]:
    return {h.id: assess(h, version, patch_codes, active) for h in HAZARDS}


def refuse_config(version: str | None) -> tuple[Hazard, ...]:
    """The ``refuse-config`` rows that concern release ``version``: the settings to
    check at engine start there (none on an unknown or unreadable release)."""
    if version is None:
        return ()
    try:
        return tuple(h for h in HAZARDS if h.action == REFUSE_CONFIG and h.affects(version))
    except ValueError:
        return ()
