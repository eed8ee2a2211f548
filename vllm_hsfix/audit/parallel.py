"""Judging many files in worker processes, in batches (:func:`.batched.audit_files`).

The pool is the one part of the audit with process-level concerns: the start method
(fork where it is safe, else forkserver or spawn), numpy loaded before forking so the
workers inherit it, batching (one task per file costs a pickle round trip and a queue
hop per file: on small files that, not the disk, set the pace), and a worker that dies
(OOM, a signal) pinned on the file that killed it, not on the files it took down with
it nor, when no worker can run at all, on any file (see :func:`run_pool`).
:func:`batches` is shared with the Ray backend.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence

from . import batched, blas, kernel, wire
from .reports import CORRUPT, FileReport

ResultFn = Callable[[int, FileReport], None]

# A task holds at most this many files or bytes, and there are at least
# TASKS_PER_WORKER tasks per worker while files last (so the pool stays balanced and a
# retry after a crash redoes little).
MAX_BATCH_FILES = 64
MAX_BATCH_BYTES = 256 * 1024 * 1024
TASKS_PER_WORKER = 4


def default_workers() -> int:
    """min(4, CPUs): past a few processes the scan is bound by the disk, not the CPU."""
    return max(1, min(4, os.cpu_count() or 1))


def batches(sizes: Sequence[int], workers: int) -> list[range]:
    """File indices cut into consecutive tasks (see ``MAX_BATCH_*``), each a range: no
    object per file (at 10^6 files, lists of indices were 36 MB of the driver)."""
    n = len(sizes)
    per = max(1, min(MAX_BATCH_FILES, -(-n // max(1, workers * TASKS_PER_WORKER))))
    out: list[range] = []
    start = cur_bytes = 0
    for i, size in enumerate(sizes):
        if i > start and (i - start >= per or cur_bytes + size > MAX_BATCH_BYTES):
            out.append(range(start, i))
            start, cur_bytes = i, 0
        cur_bytes += size
    if n > start:
        out.append(range(start, n))
    return out


def run_batch(paths: list[str], total_bytes: int = 0) -> list[FileReport]:
    """One task: judge each file (``pending`` while its writer holds the lock; small
    files of one shape as one array, :mod:`.batched`; never raises), the reports packed
    for the trip to the driver (:mod:`.wire`). ``total_bytes``: the whole audit's size, which
    decides whether this worker uses the compiled kernel (:func:`.kernel.enable`)."""
    if total_bytes:
        kernel.enable(total_bytes)
    with blas.single_thread():  # whole products for the prefix sketches (:mod:`.blas`)
        return wire.Reports(batched.audit_files(paths))  # pickled as columns


def crashed_report(path: str, exc: BaseException) -> FileReport:
    """The verdict on a file whose worker died on it (local pool and Ray alike)."""
    rep = FileReport(path=path)
    with contextlib.suppress(OSError):
        rep.bytes = os.path.getsize(path)
    rep.add("unreadable", CORRUPT, f"audit worker died ({exc!r}); file changed while read?")
    return rep


def _context() -> object:
    import multiprocessing
    import threading

    # fork starts workers in milliseconds and needs no importable __main__ (stdin scripts,
    # notebooks), but forking a threaded process can deadlock the child: there, use
    # forkserver (spawn where it is missing).
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        method = "fork"
    else:
        method = "forkserver" if "forkserver" in methods else "spawn"
    return multiprocessing.get_context(method)


def run_pool(files: list[str], sizes: Sequence[int], workers: int, on_result: ResultFn) -> None:
    """Audit ``files`` in worker processes (numpy releases little of the GIL for this
    work, so threads would not scale); ``on_result(index, report)`` as each file is
    judged. A worker killed mid-file (OOM, a signal) breaks the pool: the files it
    took down are retried one per fresh process, so the crash is pinned on the file
    that causes it."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    ctx = _context()
    import numpy  # loaded once here, so forked workers inherit it

    # The compiled kernel, when the audit is large enough: compiled here once, so forked
    # workers inherit it (others compile or load numba's cache in run_batch).
    total = int(numpy.asarray(sizes).sum())
    kernel.enable(total)

    failed: list[int] = []
    got = 0
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:  # type: ignore[arg-type]
        futures = {
            pool.submit(run_batch, [files[i] for i in batch], total): batch
            for batch in batches(sizes, workers)
        }
        for fut in as_completed(futures):
            # Popped, so the future and the reports it holds go once they are handed on
            # (kept in the dict, every file's report stayed until the pool closed: 6 KB
            # a file of the driver's memory on small files).
            batch = futures.pop(fut)
            try:
                reps = fut.result()
            except Exception:
                failed += batch
                continue
            for i, rep in zip(batch, reps, strict=True):
                got += 1
                on_result(i, rep)
            del reps, fut
    # A worker that dies breaks the whole pool, so every file still in flight lands
    # here: retry each alone, and only then decide which ones kill a worker.
    crashed: dict[int, BaseException] = {}
    for i in sorted(failed):
        try:
            with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:  # type: ignore[arg-type]
                rep = pool.submit(run_batch, [files[i]], total).result()[0]
        except Exception as exc:
            crashed[i] = exc
            continue
        got += 1
        on_result(i, rep)
    if crashed and not got:
        # Nothing has ever come back: the workers cannot run here at all, which says
        # nothing about the files. Do not call them corrupt.
        exc = next(iter(crashed.values()))
        raise RuntimeError(f"audit worker processes cannot run: {exc!r}") from exc
    for i, exc in crashed.items():
        on_result(i, crashed_report(files[i], exc))
