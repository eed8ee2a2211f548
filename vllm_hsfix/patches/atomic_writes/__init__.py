"""The ``atomic-writes`` unit: its row here, the fix and its gate in ``fix``."""

from ..spec import CONNECTOR, PatchSpec

ROW = PatchSpec(
    id="atomic-writes",
    module=CONNECTOR,
    attribute="ExampleHiddenStatesConnector._write_tensors",
    first="0.22.0",
    fixed_in=None,
    not_needed=(
        "not applied before 0.22.0: 0.17-0.21 save synchronously inside the step "
        "(save_kv_layer), with no writer thread and no .lock"
    ),
    why=(
        "beyond upstream: the writer thread writes the final path in place, so a worker "
        "killed mid-write (or a full disk) leaves a truncated file there under "
        "safetensors < 0.8.0, and readers waiting on the .lock then read it; write to a "
        "temporary file in the same directory, fsync, rename into place, then release "
        "the lock (opt out: VLLM_HSFIX_DISABLED_PATCHES=atomic-writes)"
    ),
    upstream="none (beyond upstream; safetensors >= 0.8.0 renames into place itself)",
    impl="vllm_hsfix.patches.atomic_writes.fix",
    wraps=(
        "ExampleHiddenStatesConnector._write_tensors",
        "ExampleHiddenStatesConnector.__init_subclass__",
    ),
    optional=True,
)

# The decision scripts/fingerprints.py states for it, written by hand from upstream's
# PRs, apart from ROW: (first release affected, first with upstream's fix, CPU build only).
# Beyond upstream: write to a temporary file, then rename; every release read
# from 0.22.0 on writes in place.
STATED = ("0.22.0", None, False)

# The hazard this row covers (hazards.py derives its releases from the row).
HAZARD = dict(
    id="torn-files",
    loses="data",
    upstream="none in vLLM; safetensors PR 764 (0.8.0) makes save_file rename into place",
)
