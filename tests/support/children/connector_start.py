"""``connector_start.py MODEL OUT CASES`` builds the real connector with a real
``VllmConfig`` per case (``{name: [max_model_len, prefix_caching, role]}``), vllm-hsfix
applied, then once after ``unapply()``; prints per case the warnings logged, the error
raised and the config checks' status, as one JSON line."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import vllm_hsfix

MODEL, OUT, CASES = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
records: list[str] = []


class Keep(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            records.append(record.getMessage())


def build(max_len: int, prefix: bool, role: str) -> dict[str, Any]:
    """One connector (vLLM imported after ``apply()``, at the first call)."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as m
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    config = EngineArgs(
        model=MODEL, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
        enable_chunked_prefill=False, enable_prefix_caching=prefix, block_size=16,
        max_model_len=max_len,
        speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}},
        kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": OUT}},
    ).create_engine_config()  # fmt: skip
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    group = KVCacheGroupSpec(["model.layers.0.self_attn"], spec)
    kv = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group])
    del records[:]
    error = None
    try:
        conn = m.ExampleHiddenStatesConnector(
            vllm_config=config, role=getattr(KVConnectorRole, role), kv_cache_config=kv
        )
        ex = getattr(conn, "_executor", None)
        if ex is not None:
            ex.shutdown(wait=False)
    except Exception as exc:
        error = {"type": type(exc).__name__, "message": str(exc)}
    prefix_on = config.cache_config.enable_prefix_caching
    return {"warnings": list(records), "error": error, "prefix": prefix_on}


vllm_hsfix.apply()
logging.getLogger("vllm_hsfix").addHandler(Keep())
out = {case: build(*args) for case, args in CASES.items()}
out["status"] = vllm_hsfix.status()["config_checks"]
vllm_hsfix.unapply()  # the check's wrapper goes with the patches
out["after-unapply"] = build(66, True, "SCHEDULER")
print(json.dumps(out))
