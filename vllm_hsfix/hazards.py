"""The hazard register: known ways a pinned vLLM loses or corrupts hidden states on the
extraction path, and what vllm-hsfix does about each (``patch``, ``refuse-config`` or
``documented``). Each row's trigger, evidence and measurements: ``docs/hazards.md``.
Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .codes import IN_PLACE, Code
from .patches import by_id as patch_row
from .releases import key

PATCH, REFUSE_CONFIG, DOCUMENTED = "patch", "refuse-config", "documented"
ACTIONS = (PATCH, REFUSE_CONFIG, DOCUMENTED)
PROCESS, DATA = "process", "data"  # what is lost
NOT_AFFECTED, FIXED_UPSTREAM, PATCHED, CHECKED, OPEN, EXPOSED, UNKNOWN = (
    "not-affected",
    "fixed-upstream",
    "patched",
    "checked-at-start",
    "open",
    "exposed",
    "unknown",
)


@dataclass(frozen=True)
class Hazard:
    """One known hazard. ``first`` and ``fixed_in`` bound the affected releases
    (``fixed_in`` None: no upstream fix); ``ends`` bounds them instead where the code
    concerned went away without a fix."""

    id: str
    first: str
    fixed_in: str | None
    loses: str  # PROCESS or DATA
    upstream: str
    action: str
    why_action: str = ""  # for DOCUMENTED: why nothing better is done
    patch: str = ""  # the patch row, for PATCH
    setting: str = ""  # the setting to change, for REFUSE_CONFIG
    workaround: str = ""  # for DOCUMENTED: what a user can do
    models: str = ""  # only these models are concerned ("" = any)
    ends: str | None = None

    @property
    def until(self) -> str | None:
        return self.fixed_in or self.ends

    @property
    def releases(self) -> str:
        """PEP 440 specifiers of the releases affected."""
        return f">={self.first}" + (f",<{self.until}" if self.until else "")

    def affects(self, version: str) -> bool:
        """Whether release ``version`` has the hazard (labels belong to their X.Y.Z)."""
        release = key(version)
        return key(self.first) <= release and (self.until is None or release < key(self.until))


def range_of(patch_id: str) -> dict[str, Any]:
    """A patch's hazard spans the patch row's releases: from its ``first`` to
    upstream's fix (None where upstream has none)."""
    row = patch_row(patch_id)
    return {"first": row.first, "fixed_in": row.fixed_in if row.upstream_fixed else None}


HAZARDS: tuple[Hazard, ...] = (
    Hazard(
        id="abort-before-scheduling",
        **range_of("abort-before-scheduling"),
        loses=PROCESS,
        upstream="vllm-project/vllm#56841 (merged 2026-09-14)",
        action=PATCH,
        patch="abort-before-scheduling",
    ),
    Hazard(
        id="drafter-skip",
        first="0.25.0",
        fixed_in="0.29.0",
        loses=DATA,
        upstream="vllm-project/vllm#53962 (a crash fix upstream; first released in 0.29.0)",
        action=REFUSE_CONFIG,
        setting=(
            "enable_prefix_caching=False (--no-enable-prefix-caching), or a max_model_len "
            "(--max-model-len) with max_model_len - 2 not a multiple of the scheduler's KV "
            "block size (e.g. one less)"
        ),
    ),
    Hazard(
        id="prefix-cache-slicing",
        first="0.22.0",
        fixed_in="0.24.0",
        loses=DATA,
        upstream=(
            "vllm-project/vllm#44485 (open); the 0.24.0 rewrite saves from the request's "
            "own blocks at finish"
        ),
        action=REFUSE_CONFIG,
        setting="enable_prefix_caching=False (--no-enable-prefix-caching)",
    ),
    Hazard(
        id="aux-final-layer-dropped",
        **range_of("aux-final-layer"),
        models=(
            "models on vLLM's DeepseekV2Model backbone (model_executor/models/deepseek_v2.py): "
            "DeepSeek V2/V3/V3.2, Kimi K2 (and the text stacks of Kimi K2.5 and Kimi-VL), "
            "GlmMoeDsaForCausalLM, Mistral Large 3"
        ),
        loses=DATA,
        upstream="vllm-project/vllm#46973 (first released in 0.25.0)",
        action=PATCH,
        patch="aux-final-layer",
    ),
    Hazard(
        id="torn-files",
        **range_of("atomic-writes"),
        loses=DATA,
        upstream="none in vLLM; safetensors PR 764 (0.8.0) makes save_file rename into place",
        action=PATCH,
        patch="atomic-writes",
    ),
    Hazard(
        id="torn-files-in-step",
        first="0.17.0",
        fixed_in=None,
        ends="0.22.0",
        loses=DATA,
        upstream="none; 0.22.0 moved the save to a writer thread with a .lock (still in place)",
        action=DOCUMENTED,
        why_action=(
            "a different writer (inside save_kv_layer, per step) than the one atomic-writes "
            "wraps; not patched"
        ),
        workaround="safetensors >= 0.8.0, which renames into place itself",
    ),
    Hazard(
        id="cpu-amx-gdn-conv-state",
        first="0.22.0",
        fixed_in="0.26.0",
        models=(
            "hybrid models with GDN layers (gated delta net: Qwen3-Next, Qwen3.5/3.6 and "
            "their -A3B MoE models), on vLLM's CPU build on a CPU with AMX (Intel Xeon "
            "Sapphire Rapids and later)"
        ),
        loses=PROCESS,
        upstream=(
            "vllm-project/vllm#46090 (CPU speculative decoding for GDN models; first "
            "released in 0.26.0); 0.27.0's kernels take the wide state themselves (#48577)"
        ),
        action=PATCH,
        patch="cpu-gdn-wide-conv-state",
    ),
)


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
