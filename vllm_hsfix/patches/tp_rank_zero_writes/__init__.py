"""The ``tp-rank-zero-writes`` unit: its row here, the fix and its gate in ``fix``."""

from ..spec import CONNECTOR, PatchSpec

ROW = PatchSpec(
    id="tp-rank-zero-writes",
    module=CONNECTOR,
    attribute="ExampleHiddenStatesConnector.save_kv_layer",
    first="0.17.0",
    fixed_in="0.24.0",
    not_needed="not before 0.17.0 (no hidden-states extraction there)",
    why=(
        "with tensor_parallel_size > 1 every rank saves the same file: 0.17-0.21 write it "
        "in the step from each rank, 0.22-0.23 open the same .lock with O_TRUNC on each "
        "rank and queue the steps on it, and a reader can read between two ranks' "
        "writes; save from tensor-parallel rank 0 only, as 0.24.0 does"
    ),
    upstream="vLLM 0.24.0 (the async-write rework, PR 43805, saves from TP rank 0 only)",
    impl="vllm_hsfix.patches.tp_rank_zero_writes.fix",
    wraps=("ExampleHiddenStatesConnector.save_kv_layer",),
)

# The decision scripts/fingerprints.py states for it, written by hand from the wheels,
# apart from ROW: (first release affected, first with upstream's fix, CPU build only).
# 0.17.0-0.23.x save on every rank; 0.24.0's rewrite saves on TP rank 0 only.
STATED = ("0.17.0", "0.24.0", False)

# The hazard this row covers (hazards.py derives its releases from the row).
HAZARD = dict(
    id="every-rank-writes",
    loses="data",
    upstream="vLLM 0.24.0 writes from TP rank 0 only (PR 43805); no fix for 0.17-0.23",
)
