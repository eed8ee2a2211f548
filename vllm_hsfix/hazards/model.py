"""What a hazard row is: the fields, the actions, the states ``assess`` gives.

The register's rows are in ``hazards.register``; ``hazards`` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..codes import IN_PLACE
from ..patches import by_id as patch_row
from ..releases import key

PATCH, REFUSE_CONFIG, DOCUMENTED = "patch", "refuse-config", "documented"
ACTIONS = (PATCH, REFUSE_CONFIG, DOCUMENTED)
PROCESS, DATA = "process", "data"

# assess() states. Only OPEN is a problem of vllm-hsfix's own making: a patch meant for
# this release that will not be in place (status already exits 1 for that patch).
NOT_AFFECTED, FIXED_UPSTREAM, PATCHED, CHECKED, OPEN, EXPOSED, UNKNOWN = (
    "not-affected",
    "fixed-upstream",
    "patched",
    "checked-at-start",
    "open",
    "exposed",
    "unknown",
)
# Patch decisions (as ``status`` names them) under which the patch is in place.
PATCH_IN_PLACE = IN_PLACE


@dataclass(frozen=True)
class Hazard:
    """One known hazard of the extraction path. ``first`` and ``fixed_in`` bound the
    affected releases (``fixed_in`` None: not fixed upstream in any release read);
    ``ends`` bounds them instead where the code concerned went away without a fix."""

    id: str
    first: str
    fixed_in: str | None
    trigger: str
    effect: str
    loses: str  # PROCESS or DATA
    upstream: str
    action: str
    why_action: str
    evidence: tuple[str, ...]
    measured: str
    patch: str = ""  # the patch row, for PATCH
    setting: str = ""  # the setting to change, for REFUSE_CONFIG
    workaround: str = ""
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
        """Whether release ``version`` (X.Y.Z, pre/dev/local labels belong to their
        X.Y.Z line) has the hazard."""
        release = key(version)
        if release < key(self.first):
            return False
        return self.until is None or release < key(self.until)


def range_of(patch_id: str) -> dict[str, Any]:
    """A hazard whose action is a patch affects the releases of the patch's row: from
    its ``first`` to upstream's fix (None where upstream has no fix: the row's
    ``fixed_in`` is then only the first release not read yet). One place, the row."""
    row = patch_row(patch_id)
    return {"first": row.first, "fixed_in": row.fixed_in if row.upstream_fixed else None}
