"""``cpu-connector-save``: the hidden-states connector saves on vLLM's CPU build
(docs/patches.md). Goes when: a release saves without CUDA (the gate says "fixed").
"""

from __future__ import annotations

import ast
import fcntl
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ... import checks, tested
from ...shapes import Probe, attribute_chains, method, top_level
from .._connector_io import (
    BLOCK_SIZE,
    HOST_COPY_DONE,
    save_case,
    save_problems,
    save_request,
    wait_unlocked,
)
from .._probe import calls, class_def, expect, finds, fingerprints, probes
from .._wrap import Replacement, arg, wrap
from ..hooks import Hooks

__all__ = ["save_case", "save_request", "wait_unlocked"]  # the check's pieces, for tests
PATCH_ID = "cpu-connector-save"
ATTRIBUTE = "ExampleHiddenStatesConnector"
READER = "extract_from_kv_cache"
SAVE_LAYER = "save_kv_layer"
SUBMIT = "_submit_async_write"
WRITER = "_write_tensors"
SHAPES = {"save-kv-layer": (SAVE_LAYER, "0.22-0.23"), "submit-async-write": (SUBMIT, "0.24+")}


# The fix replaces only the CUDA copy: for a host buffer, the launching method copies
# synchronously with the release's own reader, writer, thread pool and .lock protocol,
# handing the writer a completed-copy marker for the CUDA event; any other device goes
# to the release's method. It reads _block_size when it runs (hidden-group-block-size).
def host_copy(rows: Any) -> Any:
    """``rows`` copied into a fresh host tensor, blocking: the tensor the release's
    pinned buffer holds once its asynchronous copy has completed."""
    import torch

    out = torch.empty_like(rows, device="cpu")
    out.copy_(rows)
    return out


def _on_host(tensor: Any) -> bool:
    return getattr(getattr(tensor, "device", None), "type", None) == "cpu"


def _exclusive_lock(path: str) -> int:
    """The writer's side of the ``.lock`` protocol: the file opened (created, emptied)
    and held with ``LOCK_EX`` until its descriptor is closed after the write."""
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _installed_save_kv_layer(module: Any) -> Callable[..., Any]:
    """0.22-0.23: the copy is launched per layer call, per request of the step."""

    def save_kv_layer(
        wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        layer_name = arg(args, kwargs, 0, "layer_name")
        kv_layer = arg(args, kwargs, 1, "kv_layer")
        if layer_name not in instance.cache_layers:
            return None
        if not _on_host(kv_layer):
            return wrapped(*args, **kwargs)
        from vllm.model_executor.models.extract_hidden_states import (
            CacheOnlyAttentionMetadata,
        )

        attn_metadata = arg(args, kwargs, 2, "attn_metadata")
        if not isinstance(attn_metadata, CacheOnlyAttentionMetadata):
            raise TypeError(
                f"{ATTRIBUTE} saves only from CacheOnlyAttentionBackend layers, got "
                f"{type(attn_metadata).__name__}"
            )
        meta = instance._get_connector_metadata()
        if not isinstance(meta, module.ExampleHiddenStatesConnectorMetadata):
            raise TypeError(f"unexpected connector metadata {type(meta).__name__}")
        os.makedirs(instance._storage_path, exist_ok=True)
        slots = module.get_forward_context().slot_mapping[layer_name]
        start = 0
        for request in meta.requests:
            count = int(request.token_ids.shape[0])
            rows = module.extract_from_kv_cache(kv_layer, slots[start : start + count], count)
            start += count
            tensors = {"hidden_states": host_copy(rows), "token_ids": request.token_ids.clone()}
            instance._pending_copies.append(
                (tensors, HOST_COPY_DONE, request.filename, request.req_id)
            )
        return None

    return save_kv_layer


def _installed_submit(module: Any) -> Callable[..., Any]:
    """0.24+: the copy is launched once per finished request, from its blocks."""

    def submit(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        pending = arg(args, kwargs, 0, "pending")
        if not instance._is_tp_rank_zero:
            return None  # only rank 0 writes, as in the release
        kv = instance._kv_cache
        if not _on_host(kv):
            return wrapped(*args, **kwargs)
        import torch

        block_size = int(instance._block_size)
        blocks = torch.as_tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks.view(-1, 1) * block_size + torch.arange(block_size)).view(-1)
        count = int(pending.token_ids.shape[0])
        rows = module.extract_from_kv_cache(kv, slots, count)
        tensors = {"hidden_states": host_copy(rows), "token_ids": pending.token_ids.clone()}
        req_id = pending.req_id
        if instance._req_futures.get(req_id) is not None:
            raise RuntimeError(f"a second hidden-states write for request {req_id!r}")
        folder = os.path.dirname(pending.filename)
        if folder:
            os.makedirs(folder, exist_ok=True)
        lock_fd = instance._lock_fds.pop(req_id, None)  # taken on arrival, else now
        if lock_fd is None and instance.use_lock:
            lock_fd = _exclusive_lock(pending.filename + ".lock")
        future = instance._executor.submit(
            instance._write_tensors, tensors, HOST_COPY_DONE, pending.filename, lock_fd
        )
        instance._req_copy_events[req_id] = HOST_COPY_DONE
        instance._req_futures[req_id] = future
        future.add_done_callback(functools.partial(instance._on_write_done, req_id))
        return None

    return submit


INSTALLERS: dict[str, Callable[[Any], Callable[..., Any]]] = {
    "save-kv-layer": _installed_save_kv_layer,
    "submit-async-write": _installed_submit,
}


def apply(module: object, shape: str, hooks: Hooks) -> list[Replacement]:
    target, _ = SHAPES[shape]
    return [wrap(getattr(module, ATTRIBUTE), target, INSTALLERS[shape](module), PATCH_ID)]


# The gate for other code: launcher and writer are tested builds' bodies, events used
# only through what the marker answers; a connector without torch.cuda is "fixed".
NAMES = ("_get_copy_stream", SAVE_LAYER, SUBMIT, WRITER, "wait_for_save", "get_finished")
EVENT_ONLY = ("elapsed_time", "ipc_handle", "from_ipc_handle")


def _fingerprints(tree: ast.Module) -> dict[str, str]:
    return {**fingerprints(tree, NAMES, ATTRIBUTE), **fingerprints(tree, (READER,))}


def shape_check(tree: ast.Module) -> Probe:
    fps = _fingerprints(tree)
    cls = class_def(tree, ATTRIBUTE)
    if cls is not None and not any(c.startswith("torch.cuda") for c in attribute_chains(cls)):
        return Probe(
            None, fixed=True, detail=f"{ATTRIBUTE} uses no CUDA stream, event or pinned copy"
        )
    shape = "submit-async-write" if method(cls, SUBMIT) is not None else "save-kv-layer"
    target, releases = SHAPES[shape]
    wait, finished = method(cls, "wait_for_save"), method(cls, "get_finished")
    wanted = {
        f"class {ATTRIBUTE}": cls is not None,
        f"{target} is a known body (of a tested build, {releases})": fps[target]
        in tested.bodies(PATCH_ID, target),
        f"{WRITER} is the known writer (of a tested build)": fps[WRITER]
        in tested.bodies(PATCH_ID, WRITER),
        "_get_copy_stream makes a torch.cuda.Stream": finds(
            method(cls, "_get_copy_stream"), "torch.cuda.Stream()"
        ),
        f"{READER}(kv_cache, slot_mapping, num_tokens) at module level": isinstance(
            top_level(tree, READER), ast.FunctionDef
        ),
        "get_finished asks the copy events query()": finds(finished, "self._req_copy_events")
        and finds(finished, "_.query()"),
        "events used only through query, synchronize, record, wait": not any(
            c.rsplit(".", 1)[-1] in EVENT_ONLY for c in calls(cls)
        ),
    }
    if shape == "save-kv-layer":
        wanted["wait_for_save hands self._pending_copies to self._write_tensors"] = finds(
            wait, "self._pending_copies"
        ) and finds(wait, "self._write_tensors")
        wanted["get_forward_context imported at module level"] = any(
            isinstance(n, ast.ImportFrom) and "get_forward_context" in {a.name for a in n.names}
            for n in tree.body
        )
    return expect(shape, f"{target} copies through a CUDA stream", wanted)


def _own(module: object) -> tuple[str, ...]:
    cls = getattr(module, ATTRIBUTE, None)
    target = SUBMIT if isinstance(cls, type) and SUBMIT in cls.__dict__ else SAVE_LAYER
    return (f"{ATTRIBUTE}.{target}",)


probe_tree, probe = probes(PATCH_ID, _fingerprints, shape_check, _own)


def new_connector(module: Any) -> Any:
    """The live class built by its ``__init__`` (block size BLOCK_SIZE), one writer."""
    conn = checks.construct_connector(getattr(module, ATTRIBUTE), None, BLOCK_SIZE)
    conn._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-hsfix-check")
    return conn


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    """The live connector saves a request from a CPU buffer through the release's own
    protocol, and the file holds exactly the request's rows."""
    name = f"{ATTRIBUTE} saves hidden states from a CPU buffer"
    return checks.one(name, lambda: check_save(module))


def check_save(module: Any) -> list[str]:
    return save_problems(module, new_connector(module))  # one request, a new connector
