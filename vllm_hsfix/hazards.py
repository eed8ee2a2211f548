"""The hazard register: known ways a pinned vLLM loses or corrupts hidden states on the
extraction path, and what vllm-hsfix does about each (``patch`` or ``documented``).
Each row's evidence: ``docs/hazards.md``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from .codes import IN_PLACE, Code
from .patches import PATCHES
from .patches import by_id as patch_row
from .releases import fixed, reached

PATCH, DOCUMENTED = "patch", "documented"
PROCESS, DATA = "process", "data"  # what is lost
NOT_AFFECTED, FIXED_UPSTREAM, PATCHED = "not-affected", "fixed-upstream", "patched"
OPEN, EXPOSED, UNKNOWN = "open", "exposed", "unknown"


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
    workaround: str = ""  # for DOCUMENTED: what a user can do
    models: str = ""  # only these models are concerned ("" = any)
    ends: str | None = None
    cpu_only: bool = False  # vLLM's CPU build only (a patched hazard: its row's platform)
    amx_only: bool = False  # only on a CPU with AMX (a kernel path no other CPU takes)

    @property
    def until(self) -> str | None:
        return self.fixed_in or self.ends

    @property
    def releases(self) -> str:
        """PEP 440 specifiers of the releases affected."""
        return f">={self.first}" + (f",<{self.until}" if self.until else "")

    def affects(self, version: str) -> bool:
        """Whether release ``version`` has the hazard (bounded as the patch rows are:
        :func:`releases.reached` and :func:`releases.fixed`)."""
        if not reached(version, self.first):
            return False
        return self.until is None or not fixed(version, self.until)


def patched(hazard_id: str, patch_id: str, **fields: Any) -> Hazard:
    """A hazard a patch row covers: its releases are the row's, from its ``first`` to
    upstream's fix (open-ended where none is known)."""
    row = patch_row(patch_id)
    return Hazard(hazard_id, row.first, row.fixed_in, action=PATCH, patch=patch_id, **fields)


def _covered() -> tuple[Hazard, ...]:
    """The hazards the patch units declare (``HAZARD`` beside their row)."""
    units = (importlib.import_module(p.impl.rsplit(".", 1)[0]) for p in PATCHES)
    declared = (({**u.HAZARD}, u.ROW.id) for u in units if hasattr(u, "HAZARD"))
    return tuple(patched(h.pop("id"), row, **h) for h, row in declared)


HAZARDS: tuple[Hazard, ...] = (
    *_covered(),
    Hazard(
        id="cpu-amx-gdn-stale-tiles",
        first="0.22.0",
        fixed_in="0.27.0",
        models="vLLM's CPU build on AMX; GDN models with 64-dim linear heads (released: 128)",
        cpu_only=True,
        amx_only=True,
        loses=PROCESS,
        upstream="0.27.0's rewritten GDN prefill kernels call brgemm_release() (no PR named)",
        action=DOCUMENTED,
        why_action="a SIGILL inside vLLM's C++ kernel, from no released model's config",
        workaround="vLLM >= 0.27.0, 128-dim linear heads, or a CPU without AMX",
    ),
)


HAZARD_IDS: tuple[str, ...] = tuple(h.id for h in HAZARDS)


def by_id(hazard_id: str) -> Hazard:
    for h in HAZARDS:
        if h.id == hazard_id:
            return h
    raise KeyError(f"unknown hazard id {hazard_id!r}; known: {list(HAZARD_IDS)}")


def _state(hazard: Hazard, version: str, patch_codes: dict[str, str]) -> tuple[str, str]:
    """(state, reason) of an affected or unaffected release (see :func:`assess`)."""
    if not hazard.affects(version):
        if hazard.fixed_in is not None and fixed(version, hazard.fixed_in):
            return FIXED_UPSTREAM, f"fixed in {hazard.fixed_in}"
        return NOT_AFFECTED, f"vLLM {version} is not {hazard.releases}"
    if hazard.action == PATCH:
        code = patch_codes.get(hazard.patch, "missing")
        if code == Code.NOT_NEEDED:  # its patch's target is not affected here
            return NOT_AFFECTED, f"patch {hazard.patch}: {code}"
        if code == Code.UPSTREAM_FIX:  # the release's code has the fix (its shape says)
            return FIXED_UPSTREAM, f"patch {hazard.patch}: {code}"
        if code in IN_PLACE:
            return PATCHED, f"patch {hazard.patch}: {code}"
        return OPEN, f"patch {hazard.patch} is {code}"
    return EXPOSED, hazard.workaround or hazard.why_action


def assess(
    hazard: Hazard,
    version: str | None,
    patch_codes: dict[str, str],
    cpu_build: bool | None = None,
    amx: bool | None = None,
) -> dict[str, str]:
    """One hazard's state on ``version`` (None: unknown), given each patch's ``status``
    code; ``open`` (its patch not in place) is the only state of vllm-hsfix's making.
    ``cpu_build``, ``amx`` (None: unknown): whether this is vLLM's CPU build, on AMX."""
    fields = ("action", "releases", "loses", "upstream", "models")  # models: where it has one
    out = {k: getattr(hazard, k) for k in fields if getattr(hazard, k)}
    if hazard.cpu_only and cpu_build is False:
        return {**out, "state": NOT_AFFECTED, "reason": "not vLLM's CPU build"}
    if hazard.amx_only and amx is False:
        return {**out, "state": NOT_AFFECTED, "reason": "this CPU has no AMX"}
    if version is None:
        return {**out, "state": UNKNOWN, "reason": "the installed vLLM release is unknown"}
    try:
        state, reason = _state(hazard, version, patch_codes)
    except ValueError:
        state, reason = UNKNOWN, f"unreadable version {version!r}"
    return {**out, "state": state, "reason": reason}


def assess_all(
    version: str | None,
    patch_codes: dict[str, str],
    cpu_build: bool | None = None,
    amx: bool | None = None,
) -> dict[str, dict[str, str]]:
    return {h.id: assess(h, version, patch_codes, cpu_build, amx) for h in HAZARDS}


def cpu_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this machine's CPU has AMX tiles (the kernel's ``amx_tile`` flag), from
    ``cpuinfo`` without importing torch; None where that cannot be read (not Linux)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    flags = [ln for ln in text.splitlines() if ln.startswith("flags")]
    return any("amx_tile" in ln.split() for ln in flags) if flags else None
