"""The ``scatter-clamp`` unit: its row here, the fix and its gate in ``fix``."""

from ..spec import PatchSpec

ROW = PatchSpec(
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
    upstream="vllm-project/vllm#46301",
    impl="vllm_hsfix.patches.scatter_clamp.fix",
    wraps=("basic_cache",),
)

# The decision scripts/fingerprints.py states for it, written by hand from upstream's
# PRs, apart from ROW: (first release affected, first with upstream's fix, CPU build only).
STATED = ("0.17.0", "0.25.0", False)
