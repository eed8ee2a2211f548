"""The ``atomic-writes-in-step`` unit: its row here, the fix and its gate in ``fix``."""

from ..spec import CONNECTOR, PatchSpec

ROW = PatchSpec(
    id="atomic-writes-in-step",
    module=CONNECTOR,
    attribute="ExampleHiddenStatesConnector.save_kv_layer",
    first="0.17.0",
    fixed_in="0.22.0",
    not_needed="not before 0.17.0 (no hidden-states extraction there)",
    why=(
        "beyond upstream: save_kv_layer writes each request's file at its final path "
        "inside the step, with no lock, so a worker killed mid-write (or a full disk) "
        "leaves a truncated file that looks like a complete one under safetensors < "
        "0.8.0; the release writes each file to a temporary name beside it, then fsync "
        "and rename into place (opt out: VLLM_HSFIX_DISABLED_PATCHES=atomic-writes-in-step)"
    ),
    upstream=(
        "none (beyond upstream; 0.22.0 moved the save to a writer thread, atomic-writes' "
        "row; safetensors >= 0.8.0 renames into place itself)"
    ),
    impl="vllm_hsfix.patches.atomic_writes_in_step.fix",
    wraps=("ExampleHiddenStatesConnector.save_kv_layer",),
    optional=True,
)

# The decision scripts/fingerprints.py states for it, written by hand from the wheels,
# apart from ROW: (first release affected, first with upstream's fix, CPU build only).
# 0.17.0-0.21.x call save_file in save_kv_layer; 0.22.0 moved the write to a thread.
STATED = ("0.17.0", "0.22.0", False)

# The hazard this row covers (hazards.py derives its releases from the row).
HAZARD = dict(
    id="torn-files-in-step",
    loses="data",
    upstream="none; 0.22.0 moved the save to a writer thread with a .lock (atomic-writes)",
)
