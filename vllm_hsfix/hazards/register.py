"""The register's rows (fields: ``hazards.Hazard``). Each row's trigger, what goes wrong,
why this action, the evidence read from the releases' files and what was measured:
``docs/hazards.md``."""

from __future__ import annotations

from .model import (
    DATA,
    DOCUMENTED,
    PATCH,
    PROCESS,
    REFUSE_CONFIG,
    Hazard,
    range_of,
)

HAZARDS: tuple[Hazard, ...] = (
    Hazard(
        id="abort-before-scheduling",
        **range_of("abort-before-scheduling"),
        loses=PROCESS,
        upstream="vllm-project/vllm#56841 (merged 2026-09-14)",
        action=PATCH,
        patch="abort-before-scheduling",
    ),
    Hazard(
        id="drafter-skip",
        first="0.25.0",
        fixed_in="0.29.0",
        loses=DATA,
        upstream="vllm-project/vllm#53962 (a crash fix upstream; first released in 0.29.0)",
        action=REFUSE_CONFIG,
        setting=(
            "enable_prefix_caching=False (--no-enable-prefix-caching), or a max_model_len "
            "(--max-model-len) with max_model_len - 2 not a multiple of the scheduler's KV "
            "block size (e.g. one less)"
        ),
    ),
    Hazard(
        id="prefix-cache-slicing",
        first="0.22.0",
        fixed_in="0.24.0",
        loses=DATA,
        upstream=(
            "vllm-project/vllm#44485 (open); the 0.24.0 rewrite saves from the request's "
            "own blocks at finish"
        ),
        action=REFUSE_CONFIG,
        setting="enable_prefix_caching=False (--no-enable-prefix-caching)",
    ),
    Hazard(
        id="aux-final-layer-dropped",
        **range_of("aux-final-layer"),
        models=(
            "models on vLLM's DeepseekV2Model backbone (model_executor/models/deepseek_v2.py): "
            "DeepSeek V2/V3/V3.2, Kimi K2 (and the text stacks of Kimi K2.5 and Kimi-VL), "
            "GlmMoeDsaForCausalLM, Mistral Large 3"
        ),
        loses=DATA,
        upstream="vllm-project/vllm#46973 (first released in 0.25.0)",
        action=PATCH,
        patch="aux-final-layer",
    ),
    Hazard(
        id="torn-files",
        **range_of("atomic-writes"),
        loses=DATA,
        upstream="none in vLLM; safetensors PR 764 (0.8.0) makes save_file rename into place",
        action=PATCH,
        patch="atomic-writes",
    ),
    Hazard(
        id="torn-files-in-step",
        first="0.17.0",
        fixed_in=None,
        ends="0.22.0",
        loses=DATA,
        upstream="none; 0.22.0 moved the save to a writer thread with a .lock (still in place)",
        action=DOCUMENTED,
        why_action=(
            "a different writer (inside save_kv_layer, per step) than the one atomic-writes "
            "wraps; not patched"
        ),
        workaround="safetensors >= 0.8.0, which renames into place itself",
    ),
    Hazard(
        id="cpu-amx-gdn-conv-state",
        first="0.22.0",
        fixed_in="0.26.0",
        models=(
            "hybrid models with GDN layers (gated delta net: Qwen3-Next, Qwen3.5/3.6 and "
            "their -A3B MoE models), on vLLM's CPU build on a CPU with AMX (Intel Xeon "
            "Sapphire Rapids and later)"
        ),
        loses=PROCESS,
        upstream=(
            "vllm-project/vllm#46090 (CPU speculative decoding for GDN models; first "
            "released in 0.26.0); 0.27.0's kernels take the wide state themselves (#48577)"
        ),
        action=PATCH,
        patch="cpu-gdn-wide-conv-state",
    ),
)
