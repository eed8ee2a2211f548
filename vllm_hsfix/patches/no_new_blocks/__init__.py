"""The ``no-new-blocks`` unit: its row here, the fix and its gate in ``fix``."""

from ..spec import CONNECTOR, PatchSpec

ROW = PatchSpec(
    id="no-new-blocks",
    module=CONNECTOR,
    attribute="ExampleHiddenStatesConnector.build_connector_meta",
    first="0.17.0",
    fixed_in="0.18.0",
    not_needed="ExampleHiddenStatesConnector does not exist before vLLM 0.17.0",
    why=(
        "a running request whose decode step allocates no new block comes with "
        "new_block_ids None, and build_connector_meta asserts it is not: any request "
        "with max_tokens > 1 kills the engine core at its second or a later step; skip "
        "such a request in that step, as 0.18.0 does"
    ),
    upstream="vllm-project/vllm (0.18.0: build_connector_meta skips new_block_ids None)",
    impl="vllm_hsfix.patches.no_new_blocks.fix",
    wraps=("ExampleHiddenStatesConnector.build_connector_meta",),
)

# The decision scripts/fingerprints.py states for it, written by hand from the wheels,
# apart from ROW: (first release affected, first with upstream's fix, CPU build only).
# 0.17.0 and 0.17.1 assert; 0.18.0 skips the request instead.
STATED = ("0.17.0", "0.18.0", False)

# The hazard this row covers (hazards.py derives its releases from the row).
HAZARD = dict(
    id="no-new-blocks",
    loses="process",
    upstream="fixed in 0.18.0 (build_connector_meta: `if new_block_ids is None: continue`)",
)
