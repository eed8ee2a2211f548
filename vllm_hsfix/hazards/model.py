"""What a hazard row is: its fields, the actions, and the states ``assess`` gives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..patches import by_id as patch_row
from ..releases import key

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
__all__ = ["key"]


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
