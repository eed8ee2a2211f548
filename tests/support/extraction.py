"""The extraction config of every test engine (``extract_hidden_states`` and
``ExampleHiddenStatesConnector`` into a directory), as the dicts ``LLM(...)`` takes."""

from __future__ import annotations

from typing import Any


def speculative_config(aux: list[int]) -> dict[str, Any]:
    """``extract_hidden_states`` of the aux layer ids ``aux``, one speculative token."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": aux}},
    }


def kv_transfer_config(storage: str) -> dict[str, Any]:
    """vLLM's hidden-states connector as the producer, writing into ``storage``."""
    return {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": storage},
    }
