"""Per-process records: what each patch did, what it replaced, who activated us.

One lock guards everything: import hooks, the vLLM plugin, the bootstrap and user
calls may race (threads) or nest (a hook firing inside another import).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._locks import ForkSafeRLock

if TYPE_CHECKING:
    from .config import Config
    from .detect import VllmInstall
    from .patches import PatchSpec
    from .patches._wrap import Replacement

# Outcome codes. ``status`` is the coarse verdict; ``code`` the precise reason.
PENDING, APPLIED, SKIPPED, REFUSED, FAILED, REVERTED = (
    "pending",
    "applied",
    "skipped",
    "refused",
    "failed",
    "reverted",
)
UNDECIDED, ARMED = "waiting-for-import", "armed"
CODES = {
    # Not decided yet: the target's code must be seen first (no vLLM found yet).
    "waiting-for-import": PENDING,
    # Decided from the target's file at activation: it is patched when imported (the
    # live module is probed again then).
    "armed": PENDING,
    "applied": APPLIED,
    "upstream-fix-present": SKIPPED,
    "not-needed": SKIPPED,
    "disabled": SKIPPED,
    "no-vllm": SKIPPED,
    "unknown-version": REFUSED,
    "unknown-shape": REFUSED,
    "error": FAILED,
    "reverted": REVERTED,
    "overwritten": REVERTED,
}

LOCK = ForkSafeRLock()


@dataclass
class Record:
    patch: PatchSpec
    code: str = UNDECIDED
    reason: str = "target module not imported yet"
    shape: str | None = None
    fingerprints: dict[str, str] = field(default_factory=dict)
    replacements: list[Replacement] = field(default_factory=list)

    @property
    def status(self) -> str:
        return CODES[self.code]

    def set(self, code: str, reason: str) -> None:
        self.code, self.reason = code, reason

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "code": self.code,
            "reason": self.reason,
            "target": self.patch.target,
            "releases": self.patch.releases,
            "upstream": self.patch.upstream,
            "shape": self.shape,
            "fingerprints": dict(self.fingerprints),
        }


@dataclass
class State:
    config: Config | None = None
    install: VllmInstall | None = None
    records: dict[str, Record] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    hooks_registered: bool = False
    enabled: bool = False
    logged: bool = False
    verify: dict[str, Any] | None = None
    provenance: bool = False
    # The eagle_aux_hidden_state_layer_ids of the connector this process registered:
    # provenance stamps them, so ``repair`` knows which layers a file holds.
    aux_layers: tuple[int, ...] | None = None
    # The engine settings that change hidden states (dtype, SSM cache dtype, language
    # model only, max_model_len), as the connector's config has them: provenance stamps
    # them, so ``repair`` runs its engine the way the extraction ran.
    engine: dict[str, Any] | None = None
    errors: list[str] = field(default_factory=list)
    # unapply() was called: later activations (plugin, import watcher, bootstrap) keep
    # out; only an explicit apply() patches this process again.
    unapplied: bool = False
    # refuse-config (``refuse_config``): the wrapper on the connector's __init__ (None
    # where the release has no such hazard), the rows it checks, and what it found at
    # each engine start in this process (hazard id -> the WARNING's text).
    config_check: Replacement | None = None
    config_checked: tuple[str, ...] = ()
    config_hazards: dict[str, str] = field(default_factory=dict)


STATE = State()
