"""How the repair's engine runs: the way the extraction ran, with room to run.

The settings that change hidden states come from the files' provenance when stamped,
else from the checkpoint and the files; ``--engine-arg`` overrides either. When
``VLLM_CPU_KVCACHE_SPACE`` is unset, the repair sizes vLLM's CPU KV cache for its batches.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections import Counter
from typing import Any

from .files import Target

ENGINE_KEYS = ("dtype", "mamba_ssm_cache_dtype", "language_model_only", "max_model_len")
FILE_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
KV_ARGS = frozenset({"kv_cache_memory_bytes", "gpu_memory_utilization"})  # the user sized it
GIB = 1 << 30
FP8_CONNECTOR = ("FP8HiddenStatesConnector", "hs_connectors.fp8_hidden_states_connector")


def parse_engine_arg(item: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (key, value): VALUE is JSON when it parses, else a string."""
    key, eq, value = item.partition("=")
    key = key.strip().replace("-", "_")
    if not eq or not key.isidentifier():
        raise argparse.ArgumentTypeError(
            f"{item}: expected KEY=VALUE, e.g. dtype=bfloat16 or enforce_eager=true "
            "(VALUE is JSON when it parses, else a string)"
        )
    try:
        return key, json.loads(value)
    except ValueError:
        return key, {"True": True, "False": False, "None": None}.get(value, value)


def _text_config(model: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint's config and its text part ({} when unreadable)."""
    try:
        with open(os.path.join(model or "", "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        cfg = {}
    cfg = cfg if isinstance(cfg, dict) else {}
    text = cfg.get("text_config")
    return cfg, text if isinstance(text, dict) else cfg


def _derived(model: str | None, targets: list[Target], cpu_build: bool) -> dict[str, Any]:
    """Settings -> (value, why), from the checkpoint and the files (no provenance)."""
    cfg, text = _text_config(model)
    out: dict[str, Any] = {}
    dtypes = Counter(t.dtype for t in targets if t.dtype in FILE_DTYPES)
    if dtypes:
        file_dtype = dtypes.most_common(1)[0][0]
        out["dtype"] = (FILE_DTYPES[file_dtype], f"the files hold {file_dtype}")
    has_processor = any(os.path.exists(os.path.join(model or "", f)) for f in PROCESSOR_FILES)
    if isinstance(cfg.get("vision_config"), dict) and not has_processor:
        out["language_model_only"] = (True, "vision config, no processor files")
    ssm = text.get("mamba_ssm_dtype") or cfg.get("mamba_ssm_dtype")
    if ssm:
        out["mamba_ssm_cache_dtype"] = (ssm, "the checkpoint's mamba_ssm_dtype")
    elif cpu_build and "linear_attention" in (text.get("layer_types") or []):
        out["mamba_ssm_cache_dtype"] = ("float32", "linear attention on vLLM's CPU build")
    return out


def said(values: dict[str, Any]) -> str:
    """``KEY=VALUE, ...`` as a user types them."""
    return ", ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in values.items())


def engine_settings(
    args: argparse.Namespace, targets: list[Target], cpu_build: bool, needed_len: int
) -> tuple[dict[str, Any], int, str]:
    """(engine keyword arguments, max_model_len, one line saying where they came from):
    the --engine-arg values win, then the most common stamp, else the derived ones."""
    user = dict(args.engine_arg)
    stamps = Counter(json.dumps(t.engine, sort_keys=True) for t in targets if t.engine)
    if stamps:
        stamped = json.loads(stamps.most_common(1)[0][0])
        settings = {k: stamped[k] for k in ENGINE_KEYS if stamped.get(k) is not None}
        max_len = int(settings.pop("max_model_len", 0) or 0)
        line = f"engine settings from the files' provenance: {said(settings) or 'none recorded'}"
        if max_len >= needed_len:
            line += f", max_model_len={max_len}"
        max_len = max(max_len, needed_len)
    else:
        derived = _derived(args.model, targets, cpu_build)
        settings = {k: v for k, (v, _) in derived.items()}
        max_len = needed_len
        told = "; ".join(f"{said({k: v})} ({why})" for k, (v, why) in derived.items())
        line = f"the files carry no engine provenance; assumed {told or 'vLLM defaults'}"
    over = {k: v for k, v in user.items() if k in settings or k in ENGINE_KEYS}
    max_len = int(user.get("max_model_len") or args.max_model_len or max_len)
    settings.update({k: v for k, v in user.items() if k != "max_model_len"})
    if over:
        return settings, max_len, line + "; --engine-arg sets " + said(over)
    return settings, max_len, line + " (--engine-arg KEY=VALUE overrides)"


def kv_bytes_per_prompt(model: str | None, engine: dict[str, Any]) -> int:
    """KV cache for one prompt of ``max_model_len`` tokens: every attention layer's K and
    V, the hidden-states cache, the linear-attention states, twice over (vLLM rounds
    pages up and aligns hybrid groups)."""
    _, text = _text_config(model)
    dtype = engine["engine_args"].get("dtype") or text.get("torch_dtype") or "bfloat16"

    def num(key: str, default: int = 0) -> int:
        return int(text.get(key) or default)

    types = text.get("layer_types") or ["full_attention"] * num("num_hidden_layers", 32)
    linear = types.count("linear_attention")
    heads = num("num_attention_heads", 32)
    hidden = num("hidden_size", 4096)
    head_dim = num("head_dim", hidden // heads)
    size = DTYPE_BYTES.get(str(dtype), 2)
    kv = (len(types) - linear) * 2 * num("num_key_value_heads", heads) * head_dim * size
    per_token = kv + max(len(engine["aux"]), 1) * hidden * size
    k_heads, k_dim = num("linear_num_key_heads"), num("linear_key_head_dim")
    v_heads, v_dim = num("linear_num_value_heads"), num("linear_value_head_dim")
    conv = (num("linear_conv_kernel_dim", 4) - 1) * (2 * k_heads * k_dim + v_heads * v_dim)
    state = v_heads * k_dim * v_dim * 4 + conv * size
    return 2 * (per_token * (engine["max_len"] + 1) + linear * state)


def kv_cache_space(model: str | None, engine: dict[str, Any], seqs: int) -> tuple[int, str] | None:
    """(GiB for ``VLLM_CPU_KVCACHE_SPACE``, one line saying so), at most half the memory
    available (then fewer prompts run at once); None when the user sized the cache."""
    import psutil

    if KV_ENV in os.environ or KV_ARGS & set(engine["engine_args"]):
        return None
    one = kv_bytes_per_prompt(model, engine)
    need = seqs * one
    gib = max(1, math.ceil(need / GIB))
    free = psutil.virtual_memory().available
    note = ""
    if gib * GIB > free // 2:
        gib = max(1, math.ceil(one / GIB), (free // 2) // GIB)
        note = f", capped at half the {free / GIB:.0f} GiB free (fewer prompts at once)"
    line = (
        f"{KV_ENV} is not set: vLLM's CPU build gets {gib} GiB of KV cache, sized for "
        f"batches of {seqs} prompts up to {engine['max_len']} tokens ({need / (1 << 20):.0f} MiB "
        f"needed){note}; set {KV_ENV} (GiB) to choose"
    )
    return gib, line


def llm_kwargs(args: argparse.Namespace, engine: dict[str, Any], scratch: str) -> dict[str, Any]:
    """vLLM's ``LLM`` arguments: no prefix caching (0.22-0.23 cut saved states short,
    0.25-0.28 can skip writes), no compilation (each prompt runs once), then the
    engine settings over them."""
    connector = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": scratch},
    }
    if engine["fp8"]:
        connector.update(kv_connector=FP8_CONNECTOR[0], kv_connector_module_path=FP8_CONNECTOR[1])
    aux = {"eagle_aux_hidden_state_layer_ids": list(engine["aux"])}
    return {
        "model": args.model,
        "skip_tokenizer_init": True,
        "enable_prefix_caching": False,
        "enable_chunked_prefill": False,
        "enforce_eager": True,
        "max_model_len": engine["max_len"],
        "tensor_parallel_size": args.tensor_parallel_size,
        "data_parallel_size": args.data_parallel_size,
        "seed": 0,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": aux},
        },
        "kv_transfer_config": connector,
        **engine["engine_args"],
    }
