"""``slots-from-blocks``: a request's file holds its own prompt's rows, whatever prefix
caching or chunking left out of the step that saves it (docs/patches.md). Goes when:
0.23.x is no longer supported.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from ... import checks
from ...shapes import Probe, method
from .._probe import class_def, expect, finds, fingerprints, params, probes
from .._wrap import Replacement, arg, wrap
from ..hooks import Hooks

PATCH_ID = "slots-from-blocks"
ATTRIBUTE = "ExampleHiddenStatesConnector"
METADATA = "ExampleHiddenStatesConnectorMetadata"
BUILD, SAVE = "build_connector_meta", "save_kv_layer"
PROMPTS = "_hsfix_prompts"  # scheduler side: request id -> Prompt, until it is saved
BLOCKS = "hsfix_blocks"  # on the step's metadata: request id -> its hidden-states blocks


# The fix, 0.21.0's and 0.24.0's rule in 0.22's save: the scheduler lists a request in
# the step that computes the last of its prompt (not the step it arrives in), with its
# hidden-states blocks; the worker reads each listed request from its own blocks, by
# handing the release's save the slots of those blocks for that one call.
@dataclass
class Prompt:
    token_ids: list[int]
    blocks: list[int]
    computed: int  # prompt tokens computed before this step (prefix-cache hits included)


def hidden_group(kv_cache_config: Any) -> int:
    """The index of the hidden-states KV-cache group (its spec: ``HiddenStateCacheSpec``)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    found = [i for i, g in enumerate(groups) if type(g.kv_cache_spec).__name__.startswith("Hidden")]
    if len(found) == 1 or len(groups) <= 1:
        return found[0] if found else 0
    raise ValueError(f"{len(found)} hidden-states groups among {len(groups)} KV-cache groups")


def track(prompts: dict[str, Prompt], out: Any, group: int) -> list[str]:
    """Update ``prompts`` from a scheduler output; the ids whose prompt completes now."""
    for new in out.scheduled_new_reqs:
        ids, blocks = list(new.prompt_token_ids or []), list(new.block_ids[group])
        prompts[new.req_id] = Prompt(ids, blocks, int(new.num_computed_tokens))
    cached = out.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", None) or ()
    for i, req_id in enumerate(cached.req_ids):
        prompt = prompts.get(req_id)
        if prompt is None:
            continue
        added = cached.new_block_ids[i]
        if added is not None:  # a resumed request gets all its blocks anew
            blocks = list(added[group])
            prompt.blocks = blocks if req_id in resumed else prompt.blocks + blocks
        prompt.computed = int(cached.num_computed_tokens[i])
    for req_id in out.finished_req_ids:
        prompts.pop(req_id, None)
    steps = out.num_scheduled_tokens
    return [
        r for r, p in prompts.items() if r in steps and p.computed + steps[r] >= len(p.token_ids)
    ]


def _installed_build() -> Any:
    def build_connector_meta(
        wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        out = arg(args, kwargs, 0, "scheduler_output")
        meta = wrapped(*args, **kwargs)  # the release's own records (file names)
        prompts = instance.__dict__.setdefault(PROMPTS, {})
        group = hidden_group(instance._kv_cache_config)
        meta.requests = []
        setattr(meta, BLOCKS, {})
        for req_id in track(prompts, out, group):
            prompt = prompts.pop(req_id)
            filename = instance._request_filenames.get(req_id)
            if filename is not None:
                meta.add_request(req_id, filename=filename, token_ids=prompt.token_ids)
                getattr(meta, BLOCKS)[req_id] = prompt.blocks
        return meta

    return build_connector_meta


def own_slots(requests: Any, blocks: dict[str, list[int]], block_size: int, like: Any) -> Any:
    """Each listed request's slots, position by position, from its own blocks."""
    import torch

    parts = []
    for request in requests:
        pos = torch.arange(int(request.token_ids.shape[0]))
        ids = torch.as_tensor(blocks[request.req_id], dtype=torch.long)
        parts.append(ids[pos // block_size] * block_size + pos % block_size)
    slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
    return slots.to(device=like.device, dtype=like.dtype)


def _installed_save(module: Any) -> Any:
    def save_kv_layer(
        wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        layer_name = arg(args, kwargs, 0, "layer_name")
        if layer_name not in instance.cache_layers or not instance.has_connector_metadata():
            return wrapped(*args, **kwargs)
        meta = instance._get_connector_metadata()
        table = module.get_forward_context().slot_mapping
        blocks = getattr(meta, BLOCKS, None)
        if blocks is None or not isinstance(table, dict):  # not built by our scheduler half
            return wrapped(*args, **kwargs)
        kv_layer, step = arg(args, kwargs, 1, "kv_layer"), table[layer_name]
        table[layer_name] = own_slots(meta.requests, blocks, int(kv_layer.shape[1]), step)
        try:
            return wrapped(*args, **kwargs)
        finally:
            table[layer_name] = step

    return save_kv_layer


def apply(module: Any, shape: str, hooks: Hooks) -> list[Replacement]:
    cls = getattr(module, ATTRIBUTE)
    return [
        wrap(cls, BUILD, _installed_build(), PATCH_ID),
        wrap(cls, SAVE, _installed_save(module), PATCH_ID),
    ]


# The gate for code of no tested build: the step-slicing save (0.22-0.23) and the parts
# of the connector the fix relies on.
SHAPE = "step-sliced"
_SLICE = "_[_ : _ + _]"


def shape_check(tree: ast.Module) -> Probe:
    cls = class_def(tree, ATTRIBUTE)
    build, save = method(cls, BUILD), method(cls, SAVE)
    meta = class_def(tree, METADATA)
    reads_step = finds(save, "get_forward_context().slot_mapping[_]")
    if save is not None and not reads_step:
        return Probe(None, fixed=True, detail=f"{SAVE} does not read the step's slot mapping")
    wanted = {
        f"class {ATTRIBUTE}": cls is not None,
        f"{SAVE}(self, layer_name, kv_layer, attn_metadata, **kwargs) slicing the step's "
        "slot mapping per request": (
            params(save)[:4] == ("self", "layer_name", "kv_layer", "attn_metadata")
            and reads_step
            and finds(save, _SLICE)
        ),
        f"{BUILD}(self, scheduler_output) records file names of scheduled_new_reqs": (
            params(build) == ("self", "scheduler_output")
            and finds(build, "scheduler_output.scheduled_new_reqs")
            and finds(build, "self._request_filenames[_]")
        ),
        f"{METADATA} is a plain @dataclass with add_request (takes an attribute)": (
            meta is not None
            and [ast.unparse(d) for d in meta.decorator_list] == ["dataclass"]
            and not finds(meta, "__slots__")
            and method(meta, "add_request") is not None
        ),
    }
    return expect(SHAPE, "each request cut out of the step's slot mapping", wanted)


def _fingerprints(tree: ast.Module) -> dict[str, str]:
    return {**fingerprints(tree, (BUILD, SAVE), ATTRIBUTE), **fingerprints(tree, (METADATA,))}


probe_tree, probe = probes(
    PATCH_ID, _fingerprints, shape_check, (f"{ATTRIBUTE}.{BUILD}", f"{ATTRIBUTE}.{SAVE}")
)


def check_listing(cls: type) -> list[str]:
    """The LIVE scheduler half: a prompt computed in two chunks after a prefix-cache hit
    is listed once, in its last chunk's step, with every one of its blocks."""
    config, want = checks.hybrid_layout()
    conn = checks.construct_connector(cls, config, want["global_block_size"])
    g = want["group"]
    blocks = ([7], [8], [5, 6])  # one list per group: the hidden group's is [5, 6]
    new = SimpleNamespace(req_id="r", prompt_token_ids=list(range(40)), block_ids=blocks,
                          num_computed_tokens=22, sampling_params=None)  # fmt: skip
    none = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[])
    first = SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=none,
                            num_scheduled_tokens={"r": 10}, finished_req_ids=set())  # fmt: skip
    later = SimpleNamespace(req_ids=["r"], new_block_ids=[([9], [9], [11])],
                            num_computed_tokens=[32], resumed_req_ids=set())  # fmt: skip
    second = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=later,
                             num_scheduled_tokens={"r": 8}, finished_req_ids=set())  # fmt: skip
    got = []
    for out in (first, second):
        meta = conn.build_connector_meta(out)
        got.append(
            [(r.req_id, len(r.token_ids), getattr(meta, BLOCKS)[r.req_id]) for r in meta.requests]
        )
    expected = [[], [("r", 40, [*blocks[g], 11])]]
    return [] if got == expected else [f"listed {got}, expected {expected}"]


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    name = f"{ATTRIBUTE}: a prefix-cached, chunked prompt saved once, from its own blocks"
    if ctx.shape is None:  # 0.24.0 on saves each request from its blocks at finish
        return [checks.result(name, [], skipped=f"vLLM {ctx.version}: not applied here")]
    return checks.one(name, lambda: check_listing(getattr(module, ATTRIBUTE)))
