"""The one vocabulary of decisions and outcomes, and the one place that turns it into words.

Every layer speaks it: ``plan`` decides (``APPLY`` or a reason not to), the runtime
records what happened (``ARMED``, ``APPLIED``, ``REVERTED`` ...), ``status`` reports a
decision before anything is applied, the repair guard and the hazards register read
those reports. A code is a ``str`` enum, so a report written as JSON holds plain
words and compares equal to the member; :meth:`Code.word` is what a user reads (only
``APPLY`` reads differently: ``status`` says ``would-apply``, because in the status
command nothing is applied yet). Stdlib only: the bootstrap and the scripts import it.
"""

from __future__ import annotations

from enum import Enum


class Code(str, Enum):
    """A patch's code. ``status`` (the coarse verdict) is :attr:`verdict`."""

    # Decisions (plan): in range, known shape -> patch it.
    APPLY = "apply"
    # Not decided yet: the target's code must be seen first (no vLLM found yet).
    WAITING = "waiting-for-import"
    # In range at activation; patched when the target is imported (probed again then).
    ARMED = "armed"
    APPLIED = "applied"
    UPSTREAM_FIX = "upstream-fix-present"
    NOT_NEEDED = "not-needed"
    DISABLED = "disabled"
    NO_VLLM = "no-vllm"
    UNKNOWN_VERSION = "unknown-version"
    UNKNOWN_SHAPE = "unknown-shape"
    ERROR = "error"
    REVERTED = "reverted"
    OVERWRITTEN = "overwritten"

    def __str__(self) -> str:
        return self.value

    @property
    def word(self) -> str:
        """What a user reads for this code in a report."""
        return _WORDS.get(self, self.value)

    @property
    def verdict(self) -> str:
        """The coarse status: pending, applied, skipped, refused, failed or reverted."""
        return _VERDICTS[self]

    @classmethod
    def read(cls, word: str) -> Code:
        """The code a report's word stands for (``would-apply`` -> ``APPLY``)."""
        return _BY_WORD[word]


PENDING, APPLIED, SKIPPED, REFUSED, FAILED, REVERTED = (
    "pending",
    "applied",
    "skipped",
    "refused",
    "failed",
    "reverted",
)

_WORDS = {Code.APPLY: "would-apply"}
_VERDICTS = {
    Code.APPLY: PENDING,
    Code.WAITING: PENDING,
    Code.ARMED: PENDING,
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
_BY_WORD = {c.word: c for c in Code} | {c.value: c for c in Code}

#: Words of a status report that mean "this patch is (or will be) in place here".
IN_PLACE = frozenset({Code.APPLY.word, Code.APPLIED.word, Code.ARMED.word})
#: Words of a status report that mean nothing needs to be done here.
NOTHING_TO_DO = frozenset({Code.UPSTREAM_FIX.word, Code.NOT_NEEDED.word})
