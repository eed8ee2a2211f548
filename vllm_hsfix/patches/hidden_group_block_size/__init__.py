"""The ``hidden-group-block-size`` unit: its row here, the fix and its gate in ``fix``."""

from ..spec import CONNECTOR, PatchSpec

ROW = PatchSpec(
    id="hidden-group-block-size",
    module=CONNECTOR,
    attribute="ExampleHiddenStatesConnector",
    first="0.24.0",
    fixed_in="0.25.0",
    not_needed=(
        "not needed before 0.24.0: 0.17-0.21 allow only one KV-cache group with this "
        "connector; 0.22-0.23 never read with the global block size"
    ),
    why=(
        "the worker rebuilds read slots with the global cache_config.block_size instead "
        "of the hidden-states group's own, so hybrid verifiers save zeros or other "
        "blocks' memory; find the group by HiddenStateCacheSpec, use its block size, "
        "fail fast on a buffer mismatch"
    ),
    upstream="vllm-project/vllm#46301",
    impl="vllm_hsfix.patches.hidden_group_block_size.fix",
    wraps=(
        "ExampleHiddenStatesConnector.__init__",
        "ExampleHiddenStatesConnector.register_kv_caches",
        "ExampleHiddenStatesConnector._find_cache_kv_group_id (added)",
        "ExampleHiddenStatesConnector._get_cache_block_size (added)",
    ),
)

# The decision scripts/fingerprints.py states for it, written by hand from upstream's
# PRs, apart from ROW: (first release affected, first with upstream's fix, CPU build only).
STATED = ("0.24.0", "0.25.0", False)
