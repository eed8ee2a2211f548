"""The ``allow-chunked-prefill`` unit: its row here, the fix and its gate in ``fix``."""

from ..spec import PatchSpec

ROW = PatchSpec(
    id="allow-chunked-prefill",
    module="vllm.config.vllm",
    attribute="VllmConfig._post_init_kv_transfer_config",
    first="0.22.0",
    fixed_in="0.24.0",
    not_needed="0.17-0.21 do not refuse chunked prefill with this connector",
    why=(
        "the engine refuses to start with this connector and chunked prefill, which is on "
        "by default (vllm serve as speculators starts it included), because the release's "
        "save cut a chunked prompt's rows out of each step; with slots-from-blocks each "
        "request is saved once from its own blocks, as 0.24.0 saves, so the refusal is "
        "lifted where slots-from-blocks is in place and kept where it is not"
    ),
    upstream="vllm-project/vllm#43805 (first released in 0.24.0: saves at finish, no refusal)",
    impl="vllm_hsfix.patches.allow_chunked_prefill.fix",
    wraps=("VllmConfig._post_init_kv_transfer_config",),
)

# The decision scripts/fingerprints.py states for it, written by hand from upstream's
# PR and the wheels, apart from ROW: (first release affected, first with upstream's
# fix, CPU build only). 0.22.0 added the refusal (0.21.0's config has none); 0.24.0
# removed it with PR 43805.
STATED = ("0.22.0", "0.24.0", False)

# The hazard this row covers (hazards.py derives its releases from the row).
HAZARD = dict(
    id="chunked-prefill-refused",
    loses="process",
    upstream="vllm-project/vllm#43805 (first released in 0.24.0)",
)
