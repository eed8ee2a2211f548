"""The CUDA build's connector file of every release, from the cache's skeletons
(``scripts/vllm_env.py skeletons``): what the shape probes read, release by release."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import CACHE

SKELETONS = CACHE / "cuda-skeletons"
CONN = Path("vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py")
RELEASES = [f"0.{minor}.0" for minor in range(17, 34)]  # 0.17.0 ... 0.33.0


def connector_file(release: str) -> Path:
    path = SKELETONS / f"vllm-{release}" / CONN
    if not path.exists():
        pytest.skip(f"no CUDA skeleton of vLLM {release} here ({path})")
    return path
