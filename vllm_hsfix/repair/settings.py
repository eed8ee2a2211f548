"""How the repair's engine runs: the way the extraction ran, and with room to run.

* ``--engine-arg KEY=VALUE`` as people type it: the value is JSON when it parses
  (``true``, ``256``, ``"bfloat16"``, ``{"a": 1}``), a plain string otherwise
  (``dtype=bfloat16``).
* The settings that change hidden states (``dtype``, ``mamba_ssm_cache_dtype``,
  ``language_model_only``, ``max_model_len``): from the files' provenance
  (``vllm_hsfix.engine``, stamped by a vLLM with vllm-hsfix) when they carry it; else
  derived from the checkpoint and the files (the files' ``hidden_states`` dtype is the
  model dtype; a checkpoint with a vision config and no processor files ran its text
  stack alone; linear attention on vLLM's CPU build ran with an fp32 SSM state, the
  only way that kernel runs), said in one line. ``--engine-arg`` overrides either.
* vLLM's CPU build sizes its KV cache from ``VLLM_CPU_KVCACHE_SPACE``, else from the
  machine's memory (and may ask for more than is free): when it is unset the repair
  sizes it for its own batches.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from typing import Any

from .targets import Target

ENGINE_KEYS = ("dtype", "mamba_ssm_cache_dtype", "language_model_only", "max_model_len")
FILE_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
# Engine arguments that size the KV cache themselves (the user's choice stands).
KV_ARGS = frozenset({"kv_cache_memory_bytes", "gpu_memory_utilization"})
GIB = 1 << 30


def parse_engine_args(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` items -> keyword arguments; ValueError names the bad item."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key.isidentifier():
            raise ValueError(
                f"--engine-arg {item}: expected KEY=VALUE, e.g. dtype=bfloat16 or "
                "enforce_eager=true (VALUE is JSON when it parses, else a string)"
            )
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = {"True": True, "False": False, "None": None}.get(value, value)
    return out


def model_config(model: str | None) -> dict[str, Any]:
    try:
        with open(os.path.join(model or "", "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _text(cfg: dict[str, Any]) -> dict[str, Any]:
    sub = cfg.get("text_config")
    return sub if isinstance(sub, dict) else cfg


def _derived(model: str | None, targets: list[Target], cpu_build: bool) -> dict[str, Any]:
    """Settings and why, from the checkpoint and the files (no provenance)."""
    cfg = model_config(model)
    out: dict[str, Any] = {}
    dtypes = Counter(t.dtype for t in targets if t.dtype in FILE_DTYPES)
    if dtypes:
        file_dtype = dtypes.most_common(1)[0][0]
        out["dtype"] = (FILE_DTYPES[file_dtype], f"the files hold {file_dtype}")
    has_processor = any(os.path.exists(os.path.join(model or "", f)) for f in PROCESSOR_FILES)
    if isinstance(cfg.get("vision_config"), dict) and not has_processor:
        out["language_model_only"] = (True, "vision config, no processor files")
    text = _text(cfg)
    ssm = text.get("mamba_ssm_dtype") or cfg.get("mamba_ssm_dtype")
    if ssm:
        out["mamba_ssm_cache_dtype"] = (ssm, "the checkpoint's mamba_ssm_dtype")
    elif cpu_build and "linear_attention" in (text.get("layer_types") or []):
        out["mamba_ssm_cache_dtype"] = ("float32", "linear attention on vLLM's CPU build")
    return out


def _stamped(targets: list[Target]) -> dict[str, Any] | None:
    """The engine settings the files' provenance names (the most common, if several)."""
    seen = Counter(json.dumps(t.engine, sort_keys=True) for t in targets if t.engine)
    if not seen:
        return None
    return dict(json.loads(seen.most_common(1)[0][0]))


def _fmt(v: Any) -> str:
    return json.dumps(v) if not isinstance(v, str) else v


def engine_settings(
    model: str | None,
    targets: list[Target],
    cpu_build: bool,
    user: dict[str, Any],
    needed_len: int,
    user_len: int | None,
) -> tuple[dict[str, Any], int, str]:
    """(engine keyword arguments that change hidden states, max_model_len, one line
    saying where they came from). ``user``: the --engine-arg values (they win)."""
    stamped = _stamped(targets)
    if stamped is not None:
        settings = {k: stamped[k] for k in ENGINE_KEYS if stamped.get(k) is not None}
        max_len = int(settings.pop("max_model_len", 0) or 0)
        said = ", ".join(f"{k}={_fmt(v)}" for k, v in settings.items())
        line = f"engine settings from the files' provenance: {said or 'none recorded'}"
        if max_len < needed_len:
            max_len = needed_len
        else:
            line += f", max_model_len={max_len}"
    else:
        derived = _derived(model, targets, cpu_build)
        settings = {k: v for k, (v, _) in derived.items()}
        max_len = needed_len
        said = "; ".join(f"{k}={_fmt(v)} ({why})" for k, (v, why) in derived.items())
        line = f"the files carry no engine provenance; assumed {said or 'vLLM defaults'}"
    over = {k: v for k, v in user.items() if k in settings or k in ENGINE_KEYS}
    if user_len:
        max_len = user_len
    if "max_model_len" in user:
        max_len = int(user["max_model_len"])
    settings.update({k: v for k, v in user.items() if k != "max_model_len"})
    if over:
        line += "; --engine-arg sets " + ", ".join(f"{k}={_fmt(v)}" for k, v in over.items())
    else:
        line += " (--engine-arg KEY=VALUE overrides)"
    return settings, max_len, line


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def kv_bytes_needed(
    model: str | None, dtype: str | None, n_aux: int, seqs: int, max_len: int
) -> int:
    """KV cache the batches need: every attention layer's K and V, the hidden-states
    cache, the linear-attention layers' states, for ``seqs`` prompts of ``max_len``
    tokens, twice over (vLLM rounds pages up and aligns hybrid groups)."""
    text = _text(model_config(model))
    layers = int(text.get("num_hidden_layers") or 32)
    types = text.get("layer_types") or ["full_attention"] * layers
    full = sum(1 for t in types if t != "linear_attention")
    linear = len(types) - full
    heads = int(text.get("num_attention_heads") or 32)
    kv = int(text.get("num_key_value_heads") or heads)
    hidden = int(text.get("hidden_size") or 4096)
    head_dim = int(text.get("head_dim") or hidden // heads)
    size = DTYPE_BYTES.get(str(dtype or text.get("torch_dtype") or "bfloat16"), 2)
    per_token = full * 2 * kv * head_dim * size + max(n_aux, 1) * hidden * size
    k_heads = int(text.get("linear_num_key_heads") or 0)
    v_heads = int(text.get("linear_num_value_heads") or 0)
    k_dim = int(text.get("linear_key_head_dim") or 0)
    v_dim = int(text.get("linear_value_head_dim") or 0)
    conv = int(text.get("linear_conv_kernel_dim") or 4)
    state = (
        v_heads * k_dim * v_dim * 4 + (conv - 1) * (2 * k_heads * k_dim + v_heads * v_dim) * size
    )
    per_seq = per_token * (max_len + 1) + linear * state
    return 2 * seqs * per_seq


def kv_cache_space(
    model: str | None, dtype: str | None, n_aux: int, seqs: int, max_len: int
) -> tuple[int, str]:
    """(GiB for ``VLLM_CPU_KVCACHE_SPACE``, one line saying so)."""
    need = kv_bytes_needed(model, dtype, n_aux, seqs, max_len)
    gib = max(1, math.ceil(need / GIB))
    free = _available_bytes()
    note = ""
    if free is not None and gib * GIB > free // 2:
        one = kv_bytes_needed(model, dtype, n_aux, 1, max_len)
        gib = max(1, math.ceil(one / GIB), (free // 2) // GIB)
        note = f", capped at half the {free / GIB:.0f} GiB free (fewer prompts at once)"
    line = (
        f"{KV_ENV} is not set: vLLM's CPU build gets {gib} GiB of KV cache, sized for "
        f"batches of {seqs} prompts up to {max_len} tokens ({need / (1 << 20):.0f} MiB "
        f"needed){note}; set {KV_ENV} (GiB) to choose"
    )
    return gib, line
