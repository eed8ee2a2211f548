"""Child programs, run by path in a fresh interpreter (``support.procs``). Nothing here
imports vllm_hsfix at module level: importing it activates it, and each child decides when."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

MODEL_MODULE = "vllm.model_executor.models.extract_hidden_states"
CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"


def main(cases: dict[str, Callable[..., Any]]) -> Any:
    """The case named by ``sys.argv[1]``, called with the arguments after it; its result."""
    return cases[sys.argv[1]](*sys.argv[2:])
