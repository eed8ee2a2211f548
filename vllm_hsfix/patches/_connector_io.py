"""The connector's write path: where the atomic-writes rows write before the rename, and
the live checks (``cpu-connector-save``, ``atomic-writes``): save a request through the
live connector, read a file once its ``.lock`` is released."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import tempfile
import threading
import time
from typing import Any

SUBMIT = "_submit_async_write"
TMP_SUFFIX = ".hsfix-tmp"
# The check's buffer: NUM_BLOCKS blocks of BLOCK_SIZE slots, HEADS = BLOCK_SIZE rows of
# HEAD values per slot (see save_case).
NUM_BLOCKS, BLOCK_SIZE, HEAD = 5, 4, 3
HEADS = BLOCK_SIZE
CHECK_LAYER = "cache_only_layers.0"


def temp_path(filename: str) -> str:
    """A fresh name next to ``filename`` (same directory, so the rename is atomic): the
    atomic-writes rows write there, then rename."""
    head, tail = os.path.split(filename)
    return os.path.join(head, f".{tail}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")


def fsync(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_case(
    block_ids: tuple[int, ...] = (3, 1), num_tokens: int = 6, dtype: str = "float32"
) -> dict[str, Any]:
    """A buffer with ``[b, i, j, c] = 1000 b + 100 (i + j) + c`` (symmetric in its middle
    axes, so blocks-first and head-major readers select the same rows) and what a save
    of one request must write, worked out without vLLM."""
    import torch

    def grid(n: int, axis: int) -> Any:
        return torch.arange(n).view([-1 if a == axis else 1 for a in range(4)])

    b, i, j, c = grid(NUM_BLOCKS, 0), grid(BLOCK_SIZE, 1), grid(BLOCK_SIZE, 2), grid(HEAD, 3)
    buffer = (1000 * b + 100 * (i + j) + c).to(getattr(torch, dtype))
    t = torch.arange(num_tokens)
    block, offset = torch.tensor(block_ids)[t // BLOCK_SIZE], t % BLOCK_SIZE
    row, col = torch.arange(HEADS).view(1, -1, 1), torch.arange(HEAD).view(1, 1, -1)
    expected = 1000 * block.view(-1, 1, 1) + 100 * (offset.view(-1, 1, 1) + row) + col
    return {
        "buffer": buffer,
        "block_ids": list(block_ids),
        "token_ids": torch.arange(7, 7 + num_tokens),
        "slots": block * BLOCK_SIZE + offset,
        "expected": expected.to(buffer.dtype),
    }


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


def save_problems(module: Any, conn: Any) -> list[str]:
    """Save one request (6 tokens over blocks 3 and 1) from a CPU buffer through the
    live connector ``conn`` and list what is wrong with the result."""
    case, req_id = save_case(), "hsfix-check-0"
    try:
        with tempfile.TemporaryDirectory(prefix="vllm-hsfix-save-") as folder:
            path = os.path.join(folder, f"{req_id}.safetensors")
            try:
                finished, _ = save_request(module, conn, case, path, req_id)
            except Exception as exc:
                return [f"the save path raised {type(exc).__name__}: {exc}"]
            if not wait_unlocked(path):
                return ["no file, or its .lock still held, 30 s after the save"]
            return _saved_problems(module.load_hidden_states(path), case, finished, req_id)
    finally:
        for fd in list(getattr(conn, "_lock_fds", {}).values()):
            with contextlib.suppress(OSError):
                os.close(fd)
        conn._executor.shutdown(wait=True)


def _saved_problems(
    saved: dict[str, Any], case: dict[str, Any], finished: Any, req_id: str
) -> list[str]:
    got, want, ids = saved.get("hidden_states"), case["expected"], saved.get("token_ids")
    found = None if got is None else (tuple(got.shape), str(got.dtype))
    problems = {
        f"get_finished did not report the request done: {finished}": req_id not in (finished or ()),
        f"hidden_states differ from the request's slots: got {found}, expected "
        f"{tuple(want.shape)} {want.dtype}": got is None
        or not (got.dtype == want.dtype and bool(got.equal(want))),
        f"token_ids {ids} != {case['token_ids']}": ids is None or not ids.equal(case["token_ids"]),
    }
    return [what for what, wrong in problems.items() if wrong]


class HostCopyDone:
    """Where the release keeps a copy's CUDA event, for a copy made synchronously:
    complete, so ``query()`` is True and ``synchronize()`` returns at once."""

    __slots__ = ()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None


HOST_COPY_DONE = HostCopyDone()


def _read_when_unlocked(path: str, seen: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    with open(path + ".lock") as lf:
        fcntl.flock(lf, fcntl.LOCK_SH)
        try:
            seen["data"] = load_file(path)
        except Exception as exc:
            seen["error"] = repr(exc)


def check_writer(cls: type, same_tensors: bool = True) -> list[str]:
    """Call the LIVE ``cls._write_tensors``; list what is wrong. The final path is a hard
    link of a witness file, which a write in place changes; a reader blocked on the lock
    must find the whole file (``same_tensors=False``, fp8: the token ids)."""
    import torch

    tensors = {"hidden_states": torch.arange(24.0).reshape(4, 2, 3), "token_ids": torch.arange(4)}
    with tempfile.TemporaryDirectory(prefix="vllm-hsfix-check-") as d:
        final, witness = os.path.join(d, "req-0.safetensors"), os.path.join(d, "witness")
        with open(witness, "wb") as fh:
            fh.write(b"old bytes")
        os.link(witness, final)
        lock_fd = os.open(final + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        seen: dict[str, Any] = {}
        reader = threading.Thread(target=_read_when_unlocked, args=(final, seen), daemon=True)
        reader.start()
        cls._write_tensors(tensors, HOST_COPY_DONE, final, lock_fd)
        reader.join(timeout=30)
        with open(witness, "rb") as fh:
            in_place = fh.read() != b"old bytes"
        leftovers = [n for n in os.listdir(d) if n.endswith(TMP_SUFFIX)]
    data = seen.get("data", {})
    wanted = ["token_ids"] if not same_tensors else list(tensors)
    problems = {
        "the file was written in place at its final path": in_place,
        f"a reader holding the lock did not find the complete file: {seen.get('error')}": (
            not data
        ),
        "the reader read other data than was written": bool(data)
        and not all(k in data and torch.equal(data[k], tensors[k]) for k in wanted),
        f"temporary files left behind: {leftovers}": bool(leftovers),
    }
    return [what for what, wrong in problems.items() if wrong]
