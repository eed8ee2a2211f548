"""``no-new-blocks``: the scheduler side of the connector takes a decode step in which a
running request gets no new block, so ``max_tokens > 1`` no longer kills the engine
(docs/patches.md). Goes when: 0.17.x is no longer supported.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
from typing import Any

from ... import checks
from ...shapes import Probe, method
from .._probe import class_def, expect, finds, fingerprints, params, probes
from .._wrap import Replacement, arg, wrap
from ..hooks import Hooks

PATCH_ID = "no-new-blocks"
ATTRIBUTE, METHOD = "ExampleHiddenStatesConnector", "build_connector_meta"


# The fix, 0.18.0's ``if new_block_ids is None: continue``: the release's method sees
# the step without the running requests that got no new block (its own records of
# them untouched), and the scheduler's output itself is left as it is.
def without_blockless(out: Any) -> Any:
    """``out``, or a shallow copy whose cached requests are those with new blocks."""
    cached = out.scheduled_cached_reqs
    keep = [i for i, b in enumerate(cached.new_block_ids) if b is not None]
    n = len(cached.req_ids)
    if len(keep) == n:
        return out
    # Every per-request list of the cached requests, cut alike (dicts and sets by id stay).
    cut = {
        f.name: [value[i] for i in keep]
        for f in dataclasses.fields(cached)
        if isinstance(value := getattr(cached, f.name), list) and len(value) == n
    }
    view = copy.copy(out)
    view.scheduled_cached_reqs = dataclasses.replace(cached, **cut)
    return view


def _installed(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    out = without_blockless(arg(args, kwargs, 0, "scheduler_output"))
    return wrapped(out, *args[1:], **{k: v for k, v in kwargs.items() if k != "scheduler_output"})


def apply(module: Any, shape: str, hooks: Hooks) -> list[Replacement]:
    return [wrap(getattr(module, ATTRIBUTE), METHOD, _installed, PATCH_ID)]


# The gate for code of no tested build: 0.17.x's loop over the cached requests, which
# reads only their ids and new block ids, asserting the latter are not None.
SHAPE = "asserts-new-blocks"


def _asserts_blocks(fn: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Assert)
        and isinstance(n.test, ast.Compare)
        and isinstance(n.test.ops[0], ast.IsNot)
        and "new_block_ids" in ast.unparse(n.test.left)
        for n in ast.walk(fn)
    )


def shape_check(tree: ast.Module) -> Probe:
    fn = method(class_def(tree, ATTRIBUTE), METHOD)
    if fn is None:
        return Probe(None, detail=f"no method {ATTRIBUTE}.{METHOD} in the module")
    if not _asserts_blocks(fn):
        return Probe(None, fixed=True, detail="no assert on a cached request's new blocks")
    reads = {
        ast.unparse(n)
        for n in ast.walk(fn)
        if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "cached_reqs"
    }
    return expect(
        SHAPE,
        "a cached request without new blocks asserted away",
        {
            f"{METHOD}(self, scheduler_output)": params(fn) == ("self", "scheduler_output"),
            "cached_reqs = scheduler_output.scheduled_cached_reqs": finds(
                fn, "scheduler_output.scheduled_cached_reqs"
            ),
            "only cached_reqs.req_ids and cached_reqs.new_block_ids read "
            f"(found {sorted(reads)})": reads
            == {"cached_reqs.req_ids", "cached_reqs.new_block_ids"},
        },
    )


TARGET = f"{ATTRIBUTE}.{METHOD}"
probe_tree, probe = probes(
    PATCH_ID, lambda tree: fingerprints(tree, (METHOD,), ATTRIBUTE), shape_check, (TARGET,)
)


def check_decode_step(cls: type) -> list[str]:
    """The live scheduler half over two steps of one request: its prompt (new, with a
    block), then a decode step that allocates no block (new_block_ids None)."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    config, block_size = layout()
    conn = checks.construct_connector(cls, config, block_size)
    blocks = tuple([1 + g] for g in range(len(config.kv_cache_groups)))
    new = _build(NewRequestData, req_id="r", prompt_token_ids=list(range(8)),
                 block_ids=blocks, num_computed_tokens=0, sampling_params=None)  # fmt: skip
    none = _build(CachedRequestData, req_ids=[], new_block_ids=[])
    decode = _build(CachedRequestData, req_ids=["r"], new_block_ids=[None], new_token_ids=[[3]],
                    num_computed_tokens=[8], num_output_tokens=[1])  # fmt: skip
    for step, (news, cached, n) in enumerate((([new], none, 8), ([], decode, 1))):
        out = _build(SchedulerOutput, scheduled_new_reqs=news, scheduled_cached_reqs=cached,
                     num_scheduled_tokens={"r": n}, total_num_scheduled_tokens=n)  # fmt: skip
        try:
            conn.build_connector_meta(out)
        except AssertionError as exc:
            return [f"step {step}: AssertionError {exc}"]
    return []


def layout() -> tuple[Any, int]:
    """A real ``KVCacheConfig``: the hybrid one where the release has a hidden-states
    cache spec (0.22+), else the one group 0.17-0.21 give the hidden-states layer."""
    import torch
    from vllm.v1 import kv_cache_interface as k

    if hasattr(k, "HiddenStateCacheSpec"):
        config, want = checks.hybrid_layout()
        return config, want["global_block_size"]
    spec = k.MLAAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    group = k.KVCacheGroupSpec(["cache_only_layers.2"], spec)
    return k.KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group]), 16


def _build(cls: type, **given: Any) -> Any:
    """A real ``cls`` (a dataclass) from ``given``, its other fields empty or zero."""
    empty = {list: [], dict: {}, set: set(), int: 0, bool: False}
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in given or not f.init:
            continue
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            continue
        kind = str(f.type)
        values[f.name] = next((v for t, v in empty.items() if kind.startswith(t.__name__)), None)
    return cls(**values, **given)


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    name = f"{ATTRIBUTE}.{METHOD} takes a decode step that allocates no block"
    return checks.one(name, lambda: check_decode_step(getattr(module, ATTRIBUTE)))
