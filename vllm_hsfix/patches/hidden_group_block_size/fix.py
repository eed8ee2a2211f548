"""``hidden-group-block-size``: the connector reads with the hidden-states group's block
size (docs/patches.md). Goes when: 0.24.x is no longer supported.
"""

from __future__ import annotations

import ast
import gc
from typing import Any

from ... import checks
from ...config import DISABLED_PATCHES
from ...errors import HsfixError
from ...shapes import Probe, assigned_attributes, body_template, method, template_of, top_level
from .._probe import class_def, expect, finds, fingerprints, probes
from .._wrap import Replacement, add, subclasses, wrap
from ..hooks import Hooks
from .checks import verify as verify  # the unit's verify: contract

PATCH_ID = "hidden-group-block-size"
ATTRIBUTE = "ExampleHiddenStatesConnector"


# The fix, upstream's names, kinds and error texts: the hidden-states group found by its
# spec's type, its block size taken in __init__, ValueError on a buffer that disagrees.
# Differences: __init__ and register_kv_caches stay the release's, wrapped; 0.24.0's
# _hs_group_idx is kept equal to the group (its own code reads and re-derives it); the
# messages add what was found; any other error while resolving fails closed (HsfixError).
def describe_groups(kv_cache_config: Any) -> str:
    parts = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec, layers = group.kv_cache_spec, list(group.layer_names)
        shown = ", ".join(layers[:3]) + (f", ... ({len(layers)} layers)" if len(layers) > 3 else "")
        parts.append(f"{i}: {type(spec).__name__}(block_size={spec.block_size}) [{shown}]")
    return "; ".join(parts)


def find_hidden_group(kv_cache_config: Any) -> int:
    """The one ``HiddenStateCacheSpec`` group; 0 without a config or with one group in
    all; anything else is ambiguous (an MLA verifier's groups): ``ValueError``."""
    if kv_cache_config is None:
        return 0
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    hidden = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    if len(hidden) == 1:
        return hidden[0]
    if not hidden and len(groups) == 1:
        return 0
    # Upstream's text first (callers match on it), then what was found.
    raise ValueError(
        "Could not uniquely identify the extract-hidden-states KV cache group among "
        f"{len(groups)} groups; the hidden-states layer must be isolated in its own group "
        "(MLA verifiers are unsupported). "
        "vllm-hsfix: cannot identify the hidden-states KV-cache group uniquely, "
        f"{len(hidden)} HiddenStateCacheSpec group(s) among {len(groups)}: "
        f"{describe_groups(kv_cache_config)}"
    )


def group_block_size(vllm_config: Any, kv_cache_config: Any, group: int) -> int:
    """The hidden-states group's own block size (global block size without a config)."""
    if kv_cache_config is None:
        return int(vllm_config.cache_config.block_size)
    return int(kv_cache_config.kv_cache_groups[group].kv_cache_spec.block_size)


def _find_cache_kv_group_id(cls: type, kv_cache_config: Any) -> int:
    """Upstream's classmethod: index of the KV-cache group holding the hidden states."""
    return find_hidden_group(kv_cache_config)


def _get_cache_block_size(vllm_config: Any, kv_cache_config: Any, cache_kv_group_id: int) -> int:
    """Upstream's staticmethod: the hidden-states group's block size, from its own spec."""
    return group_block_size(vllm_config, kv_cache_config, cache_kv_group_id)


HELPERS = {
    "_find_cache_kv_group_id": classmethod(_find_cache_kv_group_id),
    "_get_cache_block_size": staticmethod(_get_cache_block_size),
}


def resolve(connector: Any) -> None:
    """Set a connector's group and block size through its class's (upstream's) helpers."""
    config = getattr(connector, "_kv_cache_config", None)
    group = type(connector)._find_cache_kv_group_id(config)
    connector._cache_kv_group_id = connector._hs_group_idx = group
    connector._block_size = type(connector)._get_cache_block_size(
        connector._vllm_config, config, group
    )


def check_buffer(connector: Any) -> None:
    """``ValueError`` (survives ``python -O``) when the buffer's block size disagrees."""
    buffer = getattr(connector, "_kv_cache", None)
    if buffer is None or buffer.dim() < 2:
        return
    if int(buffer.shape[1]) != connector._block_size:
        if buffer.dim() == 4 and int(buffer.shape[2]) == connector._block_size:
            raise ValueError(
                f"vllm-hsfix: the registered hidden-states buffer {tuple(buffer.shape)} is "
                "head-major (vLLM 0.29+), this connector reads blocks-first; refusing to write "
                f"corrupted hidden states ({DISABLED_PATCHES}={PATCH_ID} turns the check off)"
            )
        raise ValueError(
            f"Hidden-states block-size mismatch: derived {connector._block_size} but buffer "
            f"block size is {int(buffer.shape[1])}; read slots would be wrong (likely a hybrid "
            f"block-size resolution bug). vllm-hsfix: group {checks.hidden_group(connector)}, "
            f"registered buffer {tuple(buffer.shape)} has block dimension "
            f"{int(buffer.shape[1])}; refusing to write corrupted hidden states"
        )


def _installed_init(hooks: Hooks) -> Any:
    def __init__(
        wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        wrapped(*args, **kwargs)
        try:
            resolve(instance)
        except ValueError:
            raise  # the fix's own fail-fast: an ambiguous group would save garbage
        except Exception as exc:  # fail closed: the release's own value is the bug
            hooks.on_failure(PATCH_ID, exc)
            raise HsfixError(
                f"vllm-hsfix {PATCH_ID}: cannot find the hidden-states group's block size "
                f"({type(exc).__name__}: {exc}); refusing to run a connector that would read "
                "with the global block size and save wrong hidden states. To run without this "
                f"patch anyway, set {DISABLED_PATCHES}={PATCH_ID}"
            ) from exc

    return __init__


def _installed_register_kv_caches(hooks: Hooks) -> Any:
    def register_kv_caches(
        wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        group = checks.hidden_group(instance)
        result = wrapped(*args, **kwargs)
        instance._hs_group_idx = group  # 0.24.0 re-derives it from layer names here
        check_buffer(instance)
        return result

    return register_kv_caches


def apply(module: object, shape: str, hooks: Hooks) -> list[Replacement]:
    cls = getattr(module, ATTRIBUTE)
    return [
        *(add(cls, name, impl, PATCH_ID) for name, impl in HELPERS.items()),
        wrap(cls, "__init__", _installed_init(hooks), PATCH_ID),
        wrap(cls, "register_kv_caches", _installed_register_kv_caches(hooks), PATCH_ID),
    ]


def existing_instances(cls: type) -> list[Any]:
    """Connectors built before the patch (an ``LLM`` created before ``apply()``)."""
    classes = {cls, *subclasses(cls)}
    found = {id(obj): obj for obj in gc.get_referrers(*classes) if type(obj) in classes}
    return list(found.values())


def adopt(module: object) -> str:
    """Re-resolve and check connectors built before the patch (raises for one it cannot)."""
    changed = []
    instances = existing_instances(getattr(module, ATTRIBUTE))
    for conn in instances:
        before = getattr(conn, "_block_size", None)
        resolve(conn)
        check_buffer(conn)
        if before != conn._block_size:
            changed.append(f"{before} -> {conn._block_size}")
    sizes = ", ".join(changed) or "unchanged"
    return (
        f"{len(instances)} connector(s) built before activation re-resolved (block size {sizes})"
        if instances
        else ""
    )


# The gate for code of no tested build: 0.24.0's connector, reading with the global
# block size from a blocks-first buffer (0.29+ is head-major). Upstream's names: fixed.
FIXED_MARKERS = ("_find_cache_kv_group_id", "_get_cache_block_size", "_cache_kv_group_id")
METHODS = ("__init__", "register_kv_caches", "_submit_async_write", "request_finished_all_groups")
READER = "extract_from_kv_cache"
READ_BLOCKS_FIRST = template_of(
    "def f(cache, slots, n):\n bs = cache.shape[1]\n return cache[slots // bs, slots % bs][:n]"
)


def shape_check(tree: ast.Module) -> Probe:
    cls = class_def(tree, ATTRIBUTE)
    init, reg, write, fin = (method(cls, name) for name in METHODS)
    sets = assigned_attributes(init) if init else set()
    defined = (
        {f"self.{n.name}" for n in cls.body if isinstance(n, ast.FunctionDef)} if cls else set()
    )
    present = [m for m in FIXED_MARKERS if f"self.{m}" in defined | sets]
    if present:
        return Probe(None, fixed=True, detail=f"defines {present}")
    reader = top_level(tree, READER)
    return expect(
        "0.24-worker-rebuild",
        "global block size used by the worker read",
        {
            f"class {ATTRIBUTE}": cls is not None,
            "__init__ sets self._block_size from vllm_config.cache_config.block_size": (
                "self._block_size" in sets and finds(init, "vllm_config.cache_config.block_size")
            ),
            "__init__ sets self._hs_group_idx": "self._hs_group_idx" in sets,
            "_submit_async_write reads self._block_size": finds(write, "self._block_size"),
            "register_kv_caches sets self._kv_cache": reg is not None
            and "self._kv_cache" in assigned_attributes(reg),
            "request_finished_all_groups indexes block_ids by self._hs_group_idx": finds(
                fin, "self._hs_group_idx"
            ),
            f"{READER} reads a blocks-first buffer (kv_cache[slot // shape[1], slot % shape[1]])": (
                isinstance(reader, ast.FunctionDef) and body_template(reader) == READ_BLOCKS_FIRST
            ),
        },
    )


probe_tree, probe = probes(
    PATCH_ID,
    lambda tree: {**fingerprints(tree, METHODS, ATTRIBUTE), **fingerprints(tree, (READER,))},
    shape_check,
    (f"{ATTRIBUTE}.__init__", f"{ATTRIBUTE}.register_kv_caches"),
)
