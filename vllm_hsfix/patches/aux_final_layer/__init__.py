"""The ``aux-final-layer`` unit: its row here, the fix and its gate in ``fix``."""

from ..spec import PatchSpec

ROW = PatchSpec(
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
    impl="vllm_hsfix.patches.aux_final_layer.fix",
    wraps=("DeepseekV2Model.forward",),
    models="DeepSeek-V2-backbone models (DeepseekV2Model)",
)

# The decision scripts/fingerprints.py states for it, written by hand from upstream's
# PRs, apart from ROW: (first release affected, first with upstream's fix, CPU build only).
# DeepseekV2Model captures aux states at layer inputs only from 0.18.0 (none before);
# PR 46973, first released in 0.25.0, adds the last layer's output.
STATED = ("0.18.0", "0.25.0", False)

# The hazard this row covers (hazards.py derives its releases from the row).
HAZARD = dict(
    id="aux-final-layer-dropped",
    models=(
        "models on vLLM's DeepseekV2Model backbone (model_executor/models/deepseek_v2.py): "
        "DeepSeek V2/V3/V3.2, Kimi K2 (and the text stacks of Kimi K2.5 and Kimi-VL), "
        "GlmMoeDsaForCausalLM, Mistral Large 3"
    ),
    loses="data",
    upstream="vllm-project/vllm#46973 (first released in 0.25.0)",
)
