"""Per-process records: what each patch did, what it replaced, who activated us.

One lock guards everything: import hooks, the vLLM plugin, the bootstrap and user
calls may race (threads) or nest (a hook firing inside another import).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._locks import ForkSafeRLock
from .codes import APPLIED, FAILED, PENDING, REFUSED, REVERTED, SKIPPED, Code

if TYPE_CHECKING:
    from .config import Config
    from .detect import VllmInstall
    from .patches import ExtraSpec, PatchSpec
    from .patches._wrap import Replacement

# The verdicts and codes are ``codes``' (the one vocabulary); re-exported for the runtime.
UNDECIDED, ARMED = Code.WAITING, Code.ARMED
__all__ = ["APPLIED", "ARMED", "FAILED", "PENDING", "REFUSED", "REVERTED", "SKIPPED", "UNDECIDED"]

LOCK = ForkSafeRLock()


@dataclass
class Record:
    patch: PatchSpec
    code: Code = UNDECIDED
    reason: str = "target module not imported yet"
    shape: str | None = None
    fingerprints: dict[str, str] = field(default_factory=dict)
    replacements: list[Replacement] = field(default_factory=list)

    @property
    def status(self) -> str:
        return Code(self.code).verdict

    def set(self, code: Code, reason: str) -> None:
        self.code, self.reason = Code(code), reason

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "code": self.code.word,
            "reason": self.reason,
            "target": self.patch.target,
            "releases": self.patch.releases,
            "upstream": self.patch.upstream,
            "shape": self.shape,
            "fingerprints": dict(self.fingerprints),
        }


@dataclass
class ExtraRecord:
    """What an extra (``patches.EXTRAS``) did in this process: its wrapper, if installed."""

    spec: ExtraSpec
    replacement: Replacement | None = None

    def live(self) -> bool:
        return self.replacement is not None and self.replacement.live()


@dataclass
class State:
    config: Config | None = None
    install: VllmInstall | None = None
    records: dict[str, Record] = field(default_factory=dict)
    extras: dict[str, ExtraRecord] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    hooks_registered: bool = False
    enabled: bool = False
    logged: bool = False
    verify: dict[str, Any] | None = None
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
    # refuse-config (the extra of that id): what it found at each engine start in this
    # process (hazard id -> the WARNING's text).
    config_hazards: dict[str, str] = field(default_factory=dict)


STATE = State()
