"""Per-process records; the package's one lock (``_lazy.LOCK``) guards them (hooks,
plugin, bootstrap and user calls may race or nest)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .codes import Code

if TYPE_CHECKING:
    from .config import Config
    from .detect import VllmInstall
    from .patches import PatchSpec
    from .patches._wrap import Replacement


@dataclass(eq=False)
class Record:
    patch: PatchSpec
    code: Code = Code.WAITING
    reason: str = "target module not imported yet"
    shape: str | None = None
    fingerprints: dict[str, str] = field(default_factory=dict)
    replacements: list[Replacement] = field(default_factory=list)

    @property
    def status(self) -> str:
        return self.code.status

    def set(self, code: Code, reason: str) -> None:
        self.code, self.reason = Code(code), reason


class State:
    """This process's state (one instance, :data:`STATE`)."""

    def __init__(self) -> None:
        self.config: Config | None = None
        self.install: VllmInstall | None = None
        self.records: dict[str, Record] = {}
        self.extras: dict[str, Replacement | None] = {}  # extra id -> its wrapper
        self.hooks_registered = False
        self.enabled = False
        self.logged = False
        self.verify: dict[str, Any] | None = None
        # What provenance stamps, so ``repair`` knows which layers a file holds and runs
        # its engine as the extraction ran: the connector's aux layers and settings.
        self.aux_layers: tuple[int, ...] | None = None
        self.engine: dict[str, Any] | None = None
        self.errors: list[str] = []
        # unapply() was called: only an explicit apply() patches this process again.
        self.unapplied = False


STATE = State()
