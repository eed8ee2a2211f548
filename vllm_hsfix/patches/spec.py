"""A patch row's declaration (``PatchSpec``) and what rows share; each unit's
``__init__`` holds its own row, which this module's table collects."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, NamedTuple, Protocol, runtime_checkable


@runtime_checkable
class PatchModule(Protocol):
    """What a row's ``impl`` module provides (``docs/architecture.md``); ``adopt`` and
    ``in_situ`` are optional. Typed loosely: the table sits below what it would name."""

    PATCH_ID: str

    def probe(self, module: object) -> Any: ...

    def probe_tree(self, tree: Any) -> Any: ...

    def shape_check(self, tree: Any) -> Any: ...

    def apply(self, module: object, shape: str, hooks: Any) -> list[Any]: ...

    def verify(self, module: Any, ctx: Any) -> list[dict[str, Any]]: ...


ANY, CPU = "any", "cpu"
# The module most rows and every extra (``EXTRAS``) patch: vLLM's hidden-states connector.
CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"


class PatchSpec(NamedTuple):
    """One declared patch: where it goes, on which releases and platforms, and why."""

    id: str
    module: str  # the vLLM module holding the target
    attribute: str  # the target inside it
    first: str  # the first release it is applied on
    # The first release with upstream's fix; None where none is known: there the
    # target's code shape decides, on releases read and releases not read alike.
    fixed_in: str | None
    not_needed: str  # why releases before ``first`` skip it
    why: str
    upstream: str
    impl: str  # the module keeping the PatchModule contract
    # Every name in ``module`` the patch replaces or adds: what ``apply`` returns.
    wraps: tuple[str, ...] = ()
    platform: str = ANY  # ANY, or CPU: vLLM's CPU build only
    other_platforms: str = ""  # why builds of other platforms skip it
    # Beyond upstream, opt-out: turned off, ``vllm-hsfix status`` still exits 0.
    optional: bool = False
    # The models whose engines import the target ("" = every extraction engine).
    models: str = ""

    def implementation(self) -> ModuleType:
        """The ``impl`` module, checked against :class:`PatchModule` on first load."""
        mod = importlib.import_module(self.impl)
        if getattr(mod, "_hsfix_contract_checked", None) != self.id:
            if not isinstance(mod, PatchModule):
                raise TypeError(f"{self.impl} does not implement the patch contract")
            if self.id != mod.PATCH_ID:
                raise TypeError(f"{self.impl}.PATCH_ID is {mod.PATCH_ID!r}, the row is {self.id!r}")
            mod._hsfix_contract_checked = self.id  # type: ignore[attr-defined]
        return mod

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attribute}"

    @property
    def releases(self) -> str:
        """PEP 440 specifiers of the releases it is applied on."""
        return f">={self.first}" + (f",<{self.fixed_in}" if self.fixed_in else "")

    def runs_on(self, cpu_build: bool | None) -> bool:
        """Whether the target is ever imported on a build of this platform."""
        return self.platform == ANY or (self.platform == CPU and cpu_build is True)
