"""The ``drafter-skip-guard`` unit: its row here, the fix and its gate in ``fix``."""

from ..spec import PatchSpec

ROW = PatchSpec(
    id="drafter-skip-guard",
    module="vllm.v1.core.sched.scheduler",
    attribute="Scheduler.__init__",
    first="0.25.0",
    fixed_in="0.29.0",
    not_needed="0.24.x and older pad no new request to the speculative length",
    why=(
        "a prompt served from the prefix cache but for its last token, arriving while "
        "another request decodes, is padded with the speculative token up to "
        "max_model_len; the drafter then does not fit and is skipped for the whole "
        "step, so that step's rows of every request are never written (stale cache in "
        "their files); with extract_hidden_states, such a request does not use its "
        "prefix-cache hit (it is computed whole, unpadded), so the drafter always runs"
    ),
    upstream="vllm-project/vllm#53962 (first released in 0.29.0: pad only with room left)",
    impl="vllm_hsfix.patches.drafter_skip_guard.fix",
    wraps=("Scheduler.__init__", "KVCacheManager.get_computed_blocks"),
)

# The decision scripts/fingerprints.py states for it, written by hand from upstream's
# PR and the wheels, apart from ROW: (first release affected, first with upstream's
# fix, CPU build only). 0.25.0 added the padding of new decode requests; 0.29.0 pads
# only where the sampled token still fits.
STATED = ("0.25.0", "0.29.0", False)

# The hazard this row covers (hazards.py derives its releases from the row).
HAZARD = dict(
    id="drafter-skip",
    loses="data",
    upstream="vllm-project/vllm#53962 (a crash fix upstream; first released in 0.29.0)",
)
