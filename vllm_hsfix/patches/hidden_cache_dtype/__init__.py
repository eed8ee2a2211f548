"""The ``hidden-cache-dtype`` unit: its row here, the fix and its gate in ``fix``."""

from ..spec import PatchSpec

ROW = PatchSpec(
    id="hidden-cache-dtype",
    module="vllm.model_executor.models.extract_hidden_states",
    attribute="CacheOnlyAttentionLayer.__init__",
    first="0.17.0",
    fixed_in="0.20.0",
    not_needed="CacheOnlyAttentionLayer does not exist before vLLM 0.17.0",
    why=(
        "with a quantized KV cache (--kv-cache-dtype fp8) the hidden-states layer gets the "
        "engine's cache config and asserts auto/bfloat16/float16: AssertionError when the "
        "drafter loads, the engine never starts; give the hidden-states layer the model's "
        "dtype (cache_dtype='auto'), as 0.20.0 does"
    ),
    upstream="vllm-project/vllm#39160",
    impl="vllm_hsfix.patches.hidden_cache_dtype.fix",
    wraps=("CacheOnlyAttentionLayer.__init__",),
)

# The decision scripts/fingerprints.py states for it, written by hand from the PR and the
# wheels, apart from ROW: (first release affected, first with upstream's fix, CPU build
# only). 0.17.0-0.19.1 assert on the global cache dtype; PR 39160 is in 0.20.0.
STATED = ("0.17.0", "0.20.0", False)

# The hazard this row covers (hazards.py derives its releases from the row).
HAZARD = dict(
    id="hidden-cache-dtype",
    loses="process",
    upstream="vllm-project/vllm#39160 (first released in 0.20.0)",
)
