"""The ``nested-text-config`` unit: its row here, the fix and its gate in ``fix``."""

from ..spec import PatchSpec

ROW = PatchSpec(
    id="nested-text-config",
    module="vllm.transformers_utils.configs.extract_hidden_states",
    attribute="ExtractHiddenStatesConfig.__init__",
    first="0.17.0",
    fixed_in="0.20.0",
    not_needed="ExtractHiddenStatesConfig does not exist before vLLM 0.17.0",
    why=(
        "the drafter's config copies the verifier's config through to_dict(), which turns "
        "a nested text_config (Qwen3-VL, Gemma 3 multimodal, Llama 4) into a plain dict: "
        "SpeculativeConfig then raises ValueError (the text_config 'does not have "
        "num_attention_heads') and the engine never starts; keep the verifier's own "
        "text_config object, as 0.20.0 does"
    ),
    upstream="vllm-project/vllm (0.20.0: transformers_utils/configs/extract_hidden_states.py)",
    impl="vllm_hsfix.patches.nested_text_config.fix",
    wraps=("ExtractHiddenStatesConfig.__init__",),
    models="verifiers with a nested text_config (Qwen3-VL, Gemma 3 multimodal, Llama 4)",
)

# The decision scripts/fingerprints.py states for it, written by hand from the wheels,
# apart from ROW: (first release affected, first with upstream's fix, CPU build only).
# 0.17.0-0.19.1 flatten text_config (read in each wheel); 0.20.0 puts the object back.
STATED = ("0.17.0", "0.20.0", False)

# The hazard this row covers (hazards.py derives its releases from the row).
HAZARD = dict(
    id="nested-text-config",
    loses="process",
    models="verifiers whose config nests a text_config (Qwen3-VL, Gemma 3/4 multimodal, Llama 4)",
    upstream="fixed in 0.20.0 (ExtractHiddenStatesConfig re-inserts the text_config object)",
)
