"""The ``abort-before-scheduling`` unit: its row here, the fix and its gate in ``fix``."""

from ..spec import CONNECTOR, PatchSpec

ROW = PatchSpec(
    id="abort-before-scheduling",
    module=CONNECTOR,
    attribute="ExampleHiddenStatesConnector",
    first="0.24.0",
    fixed_in="0.31.0",
    not_needed=(
        "not needed before 0.24.0: 0.17-0.21 never hold a finished request's blocks and "
        "0.22-0.23 hold every one and report it, so an abort before scheduling is consistent"
    ),
    why=(
        "a request aborted before it was ever scheduled (client timeout, cancelled task, "
        "disconnect while queued) has no file name, and request_finished's pop without a "
        "default raises KeyError: the engine core dies and every request with it; decline "
        "it (not held) and keep the worker from reporting it as finished sending, which "
        "would trip the scheduler's assert"
    ),
    upstream="vllm-project/vllm#56841",
    impl="vllm_hsfix.patches.abort_before_scheduling.fix",
    wraps=(
        "ExampleHiddenStatesConnector.request_finished",
        "ExampleHiddenStatesConnector.request_finished_all_groups",
        "ExampleHiddenStatesConnector.build_connector_meta",
        "ExampleHiddenStatesConnector.get_finished",
        "ExampleHiddenStatesConnector.get_finished_count (added)",
    ),
)

# The decision scripts/fingerprints.py states for it, written by hand from upstream's
# PRs, apart from ROW: (first release affected, first with upstream's fix, CPU build only).
# Request aborted before it was scheduled: KeyError in request_finished on
# 0.24.0-0.30.x; upstream PR 56841, first released in 0.31.0.
STATED = ("0.24.0", "0.31.0", False)

# The hazard this row covers (hazards.py derives its releases from the row).
HAZARD = dict(
    id="abort-before-scheduling",
    loses="process",
    upstream="vllm-project/vllm#56841 (merged 2026-09-14)",
)
