"""Opt-in provenance (``VLLM_HSFIX_PROVENANCE=1``): the connector's ``save_file`` adds
``vllm_hsfix.`` safetensors metadata (patches, in-situ check, aux layers, engine
settings) to each file, for ``audit`` and ``repair``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .patches._wrap import Replacement, wrap

if TYPE_CHECKING:
    from .patches.hooks import ExtraContext

PATCH_ID = "provenance"  # the extra's id and its wrapper's mark (patches.EXTRAS)
PREFIX = "vllm_hsfix."


def _installed(metadata: Callable[[], dict[str, str]]) -> Any:
    def save_file(
        wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        ours = {PREFIX + k: v for k, v in metadata().items()}
        if len(args) >= 3:
            user = dict(args[2] or {})
            args = (args[0], args[1], {**user, **ours}, *args[3:])
        else:
            kwargs = {**kwargs, "metadata": {**dict(kwargs.get("metadata") or {}), **ours}}
        return wrapped(*args, **kwargs)

    return save_file


def wanted(ctx: ExtraContext) -> bool:
    """On every release, wherever ``VLLM_HSFIX_PROVENANCE=1``."""
    return bool(ctx.config.provenance)


def install(module: object, ctx: ExtraContext) -> Replacement | None:
    """The ``provenance`` extra: wrap the connector module's ``save_file`` (None if it
    has none); ``ctx.metadata()`` gives the keys of a file written now."""
    if not callable(getattr(module, "save_file", None)):
        return None
    return wrap(module, "save_file", _installed(ctx.metadata), PATCH_ID)


def aux_layers(connector: Any) -> tuple[int, ...] | None:
    """``eagle_aux_hidden_state_layer_ids`` of the connector's speculative config."""
    try:
        spec = connector._vllm_config.speculative_config.draft_model_config.hf_config
        return tuple(int(a) for a in spec.eagle_aux_hidden_state_layer_ids)
    except Exception:  # another shape of config: no stamp, nothing breaks
        return None


def engine_settings(connector: Any) -> dict[str, Any] | None:
    """The connector's engine settings that change hidden states (provenance)."""
    try:
        config = connector._vllm_config
        model, cache = config.model_config, config.cache_config
    except Exception:
        return None
    out: dict[str, Any] = {}
    dtype = getattr(model, "dtype", None)
    if dtype is not None:
        out["dtype"] = str(dtype).removeprefix("torch.")
    ssm = getattr(cache, "mamba_ssm_cache_dtype", None)
    if ssm is not None:
        out["mamba_ssm_cache_dtype"] = str(ssm)
    mm = getattr(model, "multimodal_config", None)
    if mm is not None and getattr(mm, "language_model_only", None) is not None:
        out["language_model_only"] = bool(mm.language_model_only)
    if getattr(model, "max_model_len", None):
        out["max_model_len"] = int(model.max_model_len)
    return out
