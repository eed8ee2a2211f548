"""The one vocabulary of a patch's state: :class:`Code` (a ``str`` enum whose value is
the printed word) and the coarse ``status`` each code belongs to. Stdlib only.
"""

from __future__ import annotations

from enum import Enum

ON_IMPORT, APPLIED, SKIPPED, REFUSED, FAILED, REVERTED = (
    "on-import",
    "applied",
    "skipped",
    "refused",
    "failed",
    "reverted",
)


class Code(str, Enum):
    """What the gates decided, or what happened to the patch in this process."""

    APPLY = "would-apply"  # the gates pass: it is patched when its target is imported
    WAITING = "waiting-for-import"  # not decided yet: the target's code must be seen
    ARMED = "armed"  # release in range; the shape is checked when the target is imported
    APPLIED = "applied"
    UPSTREAM_FIX = "upstream-fix-present"
    NOT_NEEDED = "not-needed"
    DISABLED = "disabled"
    NO_VLLM = "no-vllm"
    UNKNOWN_VERSION = "unknown-version"
    UNKNOWN_SHAPE = "unknown-shape"
    ERROR = "error"
    REVERTED = "reverted"  # unapply() took it back
    OVERWRITTEN = "overwritten"  # someone replaced the patched object since

    def __str__(self) -> str:
        return self.value

    @property
    def status(self) -> str:
        """The coarse status this code belongs to."""
        return _STATUS[self]


_STATUS = {
    Code.APPLY: ON_IMPORT,
    Code.WAITING: ON_IMPORT,
    Code.ARMED: ON_IMPORT,
    Code.APPLIED: APPLIED,
    Code.UPSTREAM_FIX: SKIPPED,
    Code.NOT_NEEDED: SKIPPED,
    Code.DISABLED: SKIPPED,
    Code.NO_VLLM: SKIPPED,
    Code.UNKNOWN_VERSION: REFUSED,
    Code.UNKNOWN_SHAPE: REFUSED,
    Code.ERROR: FAILED,
    Code.REVERTED: REVERTED,
    Code.OVERWRITTEN: REVERTED,
}

#: Codes under which the patch is (or will be) in place here.
IN_PLACE = frozenset({Code.APPLY, Code.APPLIED, Code.ARMED})
#: Codes under which nothing needs to be done here.
NOTHING_TO_DO = frozenset({Code.UPSTREAM_FIX, Code.NOT_NEEDED})
