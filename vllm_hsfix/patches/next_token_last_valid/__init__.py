"""The ``next-token-last-valid`` unit: its row here, the fix and its gate in ``fix``."""

from ..spec import PatchSpec

ROW = PatchSpec(
    id="next-token-last-valid",
    module="vllm.v1.spec_decode.extract_hidden_states",
    attribute="ExtractHiddenStatesProposer.prepare_next_token_ids_padded",
    first="0.17.0",
    fixed_in=None,
    not_needed="not before 0.17.0 (no hidden-states extraction there)",
    why=(
        "the proposer reads only the first column of the sampled tokens and counts one: "
        "after an accepted draft (the model repeats a token) the next step starts from "
        "the wrong token, under async scheduling (the GPU default) the outputs repeat or "
        "shift and every later hidden state is computed on them; take the last valid "
        "token of each row and count every valid one, EAGLE's rule (PR 56442)"
    ),
    upstream="vllm-project/vllm#56417, PR 56442 (open)",
    impl="vllm_hsfix.patches.next_token_last_valid.fix",
    wraps=("ExtractHiddenStatesProposer.prepare_next_token_ids_padded",),
)

# The decision scripts/fingerprints.py states for it, written by hand from upstream's
# issue and the wheels, apart from ROW: (first release affected, first with upstream's
# fix, CPU build only). Every release read, 0.17.0-0.33.0, reads sampled_token_ids[:, 0].
STATED = ("0.17.0", None, False)

# The hazard this row covers (hazards.py derives its releases from the row).
HAZARD = dict(
    id="next-token-first-column",
    loses="data",
    upstream="vllm-project/vllm#56417; PR 56442 (open) takes the last valid token",
)
