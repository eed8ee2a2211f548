"""Tiny verifiers, built offline with ``transformers`` and random weights.

* hybrid: Qwen3-Next (``Qwen3NextForCausalLM``): linear attention (gated delta net)
  and full attention layers, the layout of Qwen3.5/3.6-A3B at toy size. vLLM's
  Qwen3-Next needs an MoE block; routing goes to all experts (2 of 2) so bf16 vs fp32
  routing cannot flip between vLLM and the reference.
* dense: Qwen3 (``Qwen3ForCausalLM``), the control with one KV-cache group.

No tokenizer is written: vLLM runs with ``skip_tokenizer_init=True`` and token-id
prompts. A stamp file makes re-builds free.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 512
HIDDEN = 256


def _stamp_ok(path: Path, key: str) -> bool:
    stamp = path / ".vllm-hsfix-model"
    return stamp.exists() and stamp.read_text() == key


def build(path: str | Path, kind: str = "hybrid", seed: int = 0) -> Path:
    """Write the model to ``path`` (idempotent) and return it."""
    import torch

    path = Path(path)
    key = json.dumps({"kind": kind, "seed": seed, "v": 1})
    if _stamp_ok(path, key):
        return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if kind == "hybrid":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        cfg = Qwen3NextConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=512,
            num_hidden_layers=4,
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "full_attention",
            ],
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=64,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            num_experts=2,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            max_position_embeddings=512,
            tie_word_embeddings=False,
        )
        model = Qwen3NextForCausalLM(cfg)
    elif kind == "dense":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=64,
            max_position_embeddings=512,
            tie_word_embeddings=False,
        )
        model = Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(f"unknown model kind {kind!r} (hybrid or dense)")
    model = model.to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    (path / ".vllm-hsfix-model").write_text(key)
    return path
