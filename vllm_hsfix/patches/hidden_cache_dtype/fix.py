"""``hidden-cache-dtype``: the hidden-states layer stores the model's dtype whatever the
engine's KV-cache dtype, so an engine with ``--kv-cache-dtype fp8`` starts
(docs/patches.md). Goes when: 0.19.x is no longer supported.
"""

from __future__ import annotations

import ast
import dataclasses
from types import SimpleNamespace
from typing import Any

from ... import checks
from ...shapes import Probe, method
from .._probe import class_def, expect, finds, fingerprints, params, probes
from .._wrap import Replacement, wrap
from ..hooks import Hooks

PATCH_ID = "hidden-cache-dtype"
LAYER, MODEL, METHOD = "CacheOnlyAttentionLayer", "ExtractHiddenStatesModel", "__init__"
PARAMS = ("self", "num_heads", "head_size", "cache_config", "prefix", "attn_type")


# The fix, PR 39160's rule: hidden states are not KV; a quantized cache dtype is the
# engine's choice for attention, and the hidden-states layer gets "auto" (the model's
# dtype) in a copy of the cache config it would have used.
def quantized(cache_dtype: str) -> bool:
    """vLLM's own test for a quantized KV-cache dtype (every release read: fp8*)."""
    return cache_dtype.startswith("fp8")


def unquantized(cache_config: Any) -> Any:
    """``cache_config`` itself, or a copy with ``cache_dtype="auto"`` where it is quantized."""
    if cache_config is None or not quantized(str(cache_config.cache_dtype)):
        return cache_config
    return dataclasses.replace(cache_config, cache_dtype="auto")


def _installed(module: Any) -> Any:
    def init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        positional = len(args) > 2
        given = args[2] if positional else kwargs.get("cache_config")
        # The layer's own fallback: the current engine config's cache config.
        config = given or module.get_current_vllm_config().cache_config
        fixed = unquantized(config)
        if fixed is not config:
            if positional:
                args = (*args[:2], fixed, *args[3:])
            else:
                kwargs = {**kwargs, "cache_config": fixed}
        return wrapped(*args, **kwargs)

    return init


def apply(module: Any, shape: str, hooks: Hooks) -> list[Replacement]:
    return [wrap(getattr(module, LAYER), METHOD, _installed(module), PATCH_ID)]


# The gate for code of no tested build: 0.17-0.19's layer (its cache config, else the
# engine's, its dtype asserted) built by a model that passes the engine's cache config.
SHAPE = "asserts-cache-dtype"


def shape_check(tree: ast.Module) -> Probe:
    layer = method(class_def(tree, LAYER), METHOD)
    model = method(class_def(tree, MODEL), METHOD)
    if model is not None and any(
        isinstance(n, ast.Call) and any(k.arg == "cache_dtype" for k in n.keywords)
        for n in ast.walk(model)
    ):
        return Probe(None, fixed=True, detail=f"{MODEL} gives its layer its own cache dtype")
    asserts = [n for n in ast.walk(layer) if isinstance(n, ast.Assert)] if layer else []
    return expect(
        SHAPE,
        "the hidden-states layer asserts an unquantized engine cache dtype",
        {
            f"{LAYER}.{METHOD}{PARAMS[1:]}": params(layer) == PARAMS,
            "cache_config or vllm_config.cache_config, then its cache_dtype": finds(
                layer, "cache_config or _.cache_config"
            )
            and finds(layer, "cache_config.cache_dtype"),
            "an assert of kv_cache_dtype in [...]": any(
                isinstance(a.test, ast.Compare) and isinstance(a.test.ops[0], ast.In)
                for a in asserts
            ),
            f"{MODEL} building {LAYER}(..., cache_config=...)": finds(
                model, "vllm_config.cache_config"
            )
            and any(
                isinstance(n, ast.Call)
                and ast.unparse(n.func) == LAYER
                and "cache_config" in [k.arg for k in n.keywords]
                for n in ast.walk(model)
            ),
        },
    )


def _fingerprints(tree: ast.Module) -> dict[str, str]:
    return fingerprints(tree, (f"{LAYER}.{METHOD}", f"{MODEL}.{METHOD}"))


probe_tree, probe = probes(PATCH_ID, _fingerprints, shape_check, (f"{LAYER}.{METHOD}",))


def check_fp8(module: Any) -> list[str]:
    """The live ``ExtractHiddenStatesModel`` built as the drafter loader builds it, with
    an fp8 engine cache: its hidden-states layer must store an unquantized dtype."""
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config

    draft = SimpleNamespace(hf_config=SimpleNamespace(eagle_aux_hidden_state_layer_ids=[1, 2]))
    model_config = SimpleNamespace(
        get_hidden_size=lambda: 64, get_total_num_hidden_layers=lambda: 2, dtype=None
    )
    engine = SimpleNamespace(
        speculative_config=SimpleNamespace(draft_model_config=draft),
        model_config=model_config,
        cache_config=CacheConfig(cache_dtype="fp8"),
    )
    with set_current_vllm_config(VllmConfig()):
        model = getattr(module, MODEL)(vllm_config=engine)
    (layer,) = model.cache_only_layers.values()
    dtype = str(layer.kv_cache_torch_dtype)
    return [f"the hidden-states layer stores {dtype}"] if "float8" in dtype else []


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    name = f"{MODEL} builds its hidden-states layer under an fp8 KV cache"
    from vllm.platforms import current_platform

    if current_platform.is_unspecified():  # a GPU build on a machine without its GPU
        return [checks.result(name, [], skipped="this vLLM build finds no device here")]
    return checks.one(name, lambda: check_fp8(module))
