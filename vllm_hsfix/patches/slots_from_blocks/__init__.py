"""The ``slots-from-blocks`` unit: its row here, the fix and its gate in ``fix``."""

from ..spec import CONNECTOR, PatchSpec

ROW = PatchSpec(
    id="slots-from-blocks",
    module=CONNECTOR,
    attribute="ExampleHiddenStatesConnector",
    first="0.22.0",
    fixed_in="0.24.0",
    not_needed=(
        "not needed before 0.22.0: 0.17-0.21 build each request's slots from its own block "
        "ids; 0.24.0 on saves from the request's own blocks when it finishes"
    ),
    why=(
        "each new request's rows are cut out of the step's slot mapping by its whole prompt "
        "length from a running offset, but the mapping holds only the tokens computed this "
        "step: with prefix caching (on by default) or a chunked prompt a file gets fewer "
        "rows than its token_ids, or another request's rows; save each request once its "
        "prompt is computed, from its own hidden-states blocks, as 0.21.0 and 0.24.0 do"
    ),
    upstream="vllm-project/vllm#44485 (open; 0.24.0's rewrite saves from the request's blocks)",
    impl="vllm_hsfix.patches.slots_from_blocks.fix",
    wraps=(
        "ExampleHiddenStatesConnector.build_connector_meta",
        "ExampleHiddenStatesConnector.save_kv_layer",
    ),
)

# The decision scripts/fingerprints.py states for it, written by hand from upstream's
# issue and the wheels, apart from ROW: (first release affected, first with upstream's
# fix, CPU build only). 0.22.0 introduced the step-slicing save; 0.24.0 replaced it.
STATED = ("0.22.0", "0.24.0", False)

# The hazard this row covers (hazards.py derives its releases from the row).
HAZARD = dict(
    id="prefix-cache-slicing",
    loses="data",
    upstream=(
        "vllm-project/vllm#44485 (open); the 0.24.0 rewrite saves from the request's own "
        "blocks at finish"
    ),
)
