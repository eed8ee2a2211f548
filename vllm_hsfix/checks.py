"""The checks that prove the fix is live, run on the patched code by the patches'
``verify`` and ``in_situ`` (and the tests). torch and vLLM load inside functions only.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any


@dataclass(frozen=True)
class Context:
    """What a patch's ``verify`` gets: the device, the installed release, and the shape
    the patch recognised (None when it was not applied)."""

    device: str
    version: str | None
    shape: str | None = None


def result(name: str, problems: list[str], **extra: Any) -> dict[str, Any]:
    """One check's row as ``verify`` reports it (``extra``: ``skipped``, ``ms``, ...)."""
    return {"check": name, "ok": not problems, "problems": problems, **extra}


def one(name: str, run: Any) -> list[dict[str, Any]]:
    """One check as ``verify`` reports it: ``run()`` lists problems; an exception is a
    problem too, never a crash of ``verify``."""
    try:
        problems = list(run())
    except Exception as exc:
        problems = [f"check could not run: {exc!r}"]
    return [result(name, problems)]


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1e3, 3)


def hybrid_layout() -> tuple[Any, dict[str, int]]:
    """A Qwen3.5-A3B-like hybrid ``KVCacheConfig`` from vLLM's own classes: attention
    and mamba at block size 528, the hidden-states group (not first) at its own 22."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        HiddenStateCacheSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    groups = [
        KVCacheGroupSpec(
            ["model.layers.3.self_attn"],
            FullAttentionSpec(block_size=528, num_kv_heads=2, head_size=256, dtype=torch.bfloat16),
        ),
        KVCacheGroupSpec(
            ["model.layers.0.linear_attn"],
            MambaSpec(block_size=528, shapes=((4, 8),), dtypes=(torch.float32,)),
        ),
        KVCacheGroupSpec(
            ["cache_only_layers.0"],
            HiddenStateCacheSpec(
                block_size=22, num_kv_heads=3, head_size=2048, dtype=torch.bfloat16
            ),
        ),
    ]
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
    return config, {"group": 2, "block_size": 22, "global_block_size": 528}


def construct_connector(cls: type, kv_cache_config: Any, global_block_size: int) -> Any:
    """An instance of ``cls`` built through its live ``__init__`` (worker role), from the
    parts of a ``VllmConfig`` the constructor reads."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    draft = SimpleNamespace(hf_config=SimpleNamespace(eagle_aux_hidden_state_layer_ids=[1, 2]))
    with tempfile.TemporaryDirectory(prefix="vllm-hsfix-check-") as storage:
        transfer = KVTransferConfig(
            kv_connector="ExampleHiddenStatesConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": storage},
        )
        config = SimpleNamespace(
            kv_transfer_config=transfer,
            cache_config=SimpleNamespace(block_size=global_block_size),
            speculative_config=SimpleNamespace(draft_model_config=draft),
        )
        conn = cls(vllm_config=config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config)
    executor = getattr(conn, "_executor", None)
    if executor is not None:
        executor.shutdown(wait=False)
    return conn


def hidden_group(connector: Any) -> Any:
    """The hidden-states group a connector reads: upstream's ``_cache_kv_group_id``,
    else 0.24.0's ``_hs_group_idx`` (None: neither is set)."""
    group = getattr(connector, "_cache_kv_group_id", None)
    return getattr(connector, "_hs_group_idx", None) if group is None else group
