"""The ``draft-column`` unit: its row here, the fix and its gate in ``fix``."""

from ..spec import PatchSpec

ROW = PatchSpec(
    id="draft-column",
    module="vllm.v1.spec_decode.extract_hidden_states",
    attribute="ExtractHiddenStatesProposer.propose",
    first="0.17.0",
    fixed_in="0.20.0",
    not_needed="ExtractHiddenStatesProposer does not exist before vLLM 0.17.0",
    why=(
        "the proposer hands back every sampled column ([B, 2] on a decode step; [B, k, 1] "
        "on 0.17.x) as its one draft token per request, and the runner copies that into "
        "its (max_num_reqs, 1) buffer: one request with a repetition penalty (or any "
        "request without async scheduling) kills the engine and every request in flight "
        "(GHSA-83vm-p52w-f9pw); return the target-sampled column only, [B, 1], as 0.20.0 does"
    ),
    upstream="vllm-project/vllm#38610 (GHSA-83vm-p52w-f9pw, CVE-2026-44223)",
    impl="vllm_hsfix.patches.draft_column.fix",
    wraps=("ExtractHiddenStatesProposer.propose",),
)

# The decision scripts/fingerprints.py states for it, written by hand from the advisory
# and the wheels, apart from ROW: (first release affected, first with upstream's fix, CPU
# build only). 0.17.x unsqueezes, 0.18.0-0.19.1 return the whole tensor; PR 38610 is in
# 0.20.0.
STATED = ("0.17.0", "0.20.0", False)

# The hazard this row covers (hazards.py derives its releases from the row).
HAZARD = dict(
    id="draft-column",
    loses="process",
    upstream="GHSA-83vm-p52w-f9pw / CVE-2026-44223; vllm-project/vllm#38610 (0.20.0)",
)
