"""The engine's configs for the hidden-states method, built from the release's own
classes on tiny checkpoints (tests of the 0.17-0.19 rows, issue 57, and of the proposer's
rows on every release): no engine starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

AUX_LAYERS = [1, 2]


def qwen3_vl_checkpoint(path: Path) -> Path:
    """A Qwen3-VL checkpoint at toy size, from transformers' own classes: Qwen3-VL-2B's
    head dim (128), grouped KV heads, interleaved M-RoPE sections and deepstack vision
    tower, with a nested ``text_config`` (model_type ``qwen3_vl_text``)."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    if (path / "config.json").exists():
        return path
    rope = {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}
    text = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                max_position_embeddings=4096, rope_scaling=rope, rope_theta=5000000.0,
                tie_word_embeddings=True)  # fmt: skip
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2,
                  out_hidden_size=256, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=[0])  # fmt: skip
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3VLForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(path)
    return path


def model_config(path: Path) -> Any:
    """The release's ``ModelConfig`` of a checkpoint, as the engine builds it."""
    from vllm.config import ModelConfig

    return ModelConfig(model=str(path), dtype="bfloat16", max_model_len=256,
                       skip_tokenizer_init=True)  # fmt: skip


def speculative_config(target: Any) -> Any:
    """The release's ``SpeculativeConfig`` for ``extract_hidden_states``, as vLLM builds
    it from ``--speculative-config`` (the aux layers in the draft's hf_config)."""
    from vllm.config import ParallelConfig, SpeculativeConfig

    return SpeculativeConfig(
        method="extract_hidden_states",
        num_speculative_tokens=1,
        draft_model_config={"hf_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYERS}},
        target_model_config=target,
        target_parallel_config=ParallelConfig(),
    )


def engine_config(path: Path, cache_dtype: str = "auto", **engine: Any) -> Any:
    """The release's ``VllmConfig`` of an extraction engine on ``path``, built as
    ``LLM(...)`` and ``vllm serve`` build it (``EngineArgs.create_engine_config``)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(path), dtype="bfloat16", max_model_len=256, skip_tokenizer_init=True,
        max_num_seqs=8, kv_cache_dtype=cache_dtype, enforce_eager=True,
        speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                            "draft_model_config": {"hf_config": {
                                "eagle_aux_hidden_state_layer_ids": AUX_LAYERS}}},
        **engine,
    )  # fmt: skip
    return args.create_engine_config()


def proposer(path: Any) -> tuple[Any, Any]:
    """The release's proposer on an engine config, its drafter model loaded as the
    runner loads it, its hidden-states KV cache allocated from the layer's own spec."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer
    from vllm.v1.worker.utils import bind_kv_cache

    config = engine_config(path)
    with set_current_vllm_config(config):
        drafter = ExtractHiddenStatesProposer(config, torch.device("cpu"))
        drafter.load_model(None)
        (name,) = drafter.attn_layer_names
        spec = config.compilation_config.static_forward_context[name].get_kv_cache_spec(config)
        kv = torch.zeros(8, spec.block_size, spec.num_kv_heads, spec.head_size, dtype=spec.dtype)
        bind_kv_cache({name: kv}, config.compilation_config.static_forward_context, [])
    return drafter, kv


def bare_proposer(path: Path) -> Any:
    """The release's proposer as the runner constructs it, its drafter not loaded (what
    the runner calls between steps needs none; 0.32's loader needs an accelerator)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer

    config = engine_config(path)
    with set_current_vllm_config(config):
        return ExtractHiddenStatesProposer(config, torch.device("cpu"))
