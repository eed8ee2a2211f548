"""``refuse-config``: the hazards triggered by a setting, checked when the scheduler's
connector is built: a WARNING naming the setting, or in strict mode a failed start.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from . import hazards
from .hazards import Hazard
from .patches._wrap import Replacement, wrap
from .patches.hooks import ExtraContext

log = logging.getLogger(__name__)

PATCH_ID = "refuse-config"  # the extra's id and its wrapper's mark (patches.EXTRAS)
MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
ATTRIBUTE = "ExampleHiddenStatesConnector"
SCHEDULER = "SCHEDULER"  # KVConnectorRole.SCHEDULER.name
NO_PREFIX_CACHING = "--no-enable-prefix-caching (enable_prefix_caching=False)"

Check = Callable[[Any, Any], "str | None"]


def scheduler_block_size(vllm_config: Any, kv_cache_config: Any) -> int:
    """The block size prefix-cache hits are aligned to: the release's
    ``resolve_kv_cache_block_sizes``, else its rule by hand (the LCM of the groups')."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    try:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        if kv_cache_config is not None:
            return int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[0])
    except (ImportError, AttributeError, ValueError):
        pass
    if len(groups) > 1:
        return math.lcm(*(int(g.kv_cache_spec.block_size) for g in groups))
    return int(vllm_config.cache_config.block_size)


def drafter_skip_lengths(max_model_len: int, block_size: int, num_spec: int) -> list[int]:
    """Cached lengths ``m`` (multiples of ``block_size``) padded to max_model_len so the
    drafter is skipped: ``max_model_len - 2n <= m <= max_model_len - 1 - n`` (PR 53962)."""
    low, high = max(1, max_model_len - 2 * num_spec), max_model_len - 1 - num_spec
    first = -(-low // block_size) * block_size
    return list(range(first, high + 1, block_size))


def safe_max_model_len(max_model_len: int, block_size: int, num_spec: int) -> int | None:
    """The largest ``max_model_len`` below the given one without the trigger (None
    when every nearby one has it, e.g. block size 1)."""
    for candidate in range(max_model_len - 1, max(max_model_len - 2 * block_size - 1, 1), -1):
        if not drafter_skip_lengths(candidate, block_size, num_spec):
            return candidate
    return None


def drafter_skip(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """drafter-skip: prefix caching on and a cached length padded to max_model_len."""
    if not vllm_config.cache_config.enable_prefix_caching:
        return None
    spec = vllm_config.speculative_config
    num_spec = int(getattr(spec, "num_speculative_tokens", None) or 1)
    max_len = int(vllm_config.model_config.max_model_len)
    size = scheduler_block_size(vllm_config, kv_cache_config)
    lengths = drafter_skip_lengths(max_len, size, num_spec)
    if not lengths:
        return None
    m = lengths[-1]
    safe = safe_max_model_len(max_len, size, num_spec)
    change = NO_PREFIX_CACHING
    if safe is not None:
        change += f", or --max-model-len {safe} (max_model_len={safe})"
    return (
        f"prefix caching is on and max_model_len={max_len} with KV block size {size}: a "
        f"prompt of {m + 1} tokens with {m} of them in the prefix cache, arriving while "
        "another request decodes, is padded to max_model_len, and the hidden-states "
        "writer is skipped for that whole step (stale rows in the file of every request "
        f"in it; fixed in vLLM 0.29.0, PR 53962). Change: {change}"
    )


def prefix_cache_slicing(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """prefix-cache-slicing (0.22-0.23, issue 44485): prefix caching on."""
    if not vllm_config.cache_config.enable_prefix_caching:
        return None
    return (
        "prefix caching is on: a prompt partly served from the prefix cache is saved with "
        "fewer rows than its token_ids, or with another request's rows (vLLM issue 44485; "
        f"vLLM 0.24.0's connector saves right). Change: {NO_PREFIX_CACHING}, or upgrade "
        "to vLLM >= 0.24.0 (a new prompt in a step with running decodes is cut wrong too: "
        "no setting avoids that but batches of new prompts only)"
    )


# One check per refuse-config row of the register (tests/test_refuse_config.py).
CHECKS: dict[str, Check] = {
    "drafter-skip": drafter_skip,
    "prefix-cache-slicing": prefix_cache_slicing,
}


def message(hazard: Hazard, version: str, found: str) -> str:
    """The WARNING (and, in strict mode, the error): hazard, release, what was found."""
    span = f"{hazard.first} up to {hazard.until}" if hazard.until else f"{hazard.first} on"
    return f"hazard {hazard.id} on vLLM {version} (affects {span}): {found}"


def _role_name(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    role = getattr(instance, "role", None)
    if role is None:
        role = kwargs.get("role", args[1] if len(args) > 1 else None)
    return str(getattr(role, "name", role))


def _installed(
    rows: tuple[Hazard, ...],
    version: str,
    on_trigger: Callable[[Hazard, str], None],
    on_error: Callable[[BaseException], None],
) -> Any:
    def __init__(
        wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        wrapped(*args, **kwargs)
        if _role_name(instance, args, kwargs) != SCHEDULER:
            return
        for hazard in rows:
            try:
                found = CHECKS[hazard.id](
                    instance._vllm_config, getattr(instance, "_kv_cache_config", None)
                )
            except Exception as exc:  # a check never stops an engine by accident
                on_error(exc)
                continue
            if found is not None:
                on_trigger(hazard, message(hazard, version, found))  # raises in strict mode

    return __init__


def install(module: object, ctx: ExtraContext) -> Replacement | None:
    """The ``refuse-config`` extra: wrap the connector's ``__init__`` to check the
    rows of ``ctx.release`` (None: nothing to check, or no connector class)."""
    rows, version = hazards.refuse_config(ctx.release), ctx.release
    on_trigger, on_error = ctx.on_config_hazard, ctx.on_config_error
    cls = getattr(module, ATTRIBUTE, None)
    if not rows or not isinstance(cls, type):
        return None
    unknown = [h.id for h in rows if h.id not in CHECKS]
    if unknown:
        raise KeyError(f"refuse-config rows without a check: {unknown}")
    return wrap(cls, "__init__", _installed(rows, version, on_trigger, on_error), PATCH_ID)
