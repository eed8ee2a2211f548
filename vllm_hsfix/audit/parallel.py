"""Running :func:`.scan.audit_file` over many files in worker processes.

The pool is the one part of the audit with process-level concerns: the start method
(fork where it is safe, else forkserver or spawn), numpy loaded before forking so the
workers inherit it, and a worker that dies (SIGBUS when a file shrinks under its
mapping, OOM) pinned on the file that killed it, not on the files it took down with it
nor, when no worker can run at all, on any file (see :func:`run_pool`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from .reports import CORRUPT, FileReport
from .scan import audit_file

ProgressFn = Callable[[int, int], None]


def default_workers() -> int:
    """min(4, CPUs): past a few processes the scan is bound by the disk, not the CPU."""
    return max(1, min(4, os.cpu_count() or 1))


def _crashed(path: str, exc: BaseException) -> FileReport:
    rep = FileReport(path=path)
    with contextlib.suppress(OSError):
        rep.bytes = os.path.getsize(path)
    rep.add("unreadable", CORRUPT, f"audit worker died ({exc!r}); file changed while read?")
    return rep


def run_pool(files: list[str], workers: int, progress: ProgressFn | None) -> list[FileReport]:
    """Audit ``files`` in worker processes (numpy releases little of the GIL for this
    work, so threads would not scale). A worker killed mid-file (SIGBUS when a file
    shrinks under its mapping, OOM) breaks the pool: the files it took down are retried
    one per fresh process, so the crash is pinned on the file that causes it."""
    import multiprocessing
    import threading
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # fork starts workers in milliseconds and needs no importable __main__ (stdin scripts,
    # notebooks), but forking a threaded process can deadlock the child: there, use
    # forkserver (spawn where it is missing).
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        method = "fork"
    else:
        method = "forkserver" if "forkserver" in methods else "spawn"
    ctx = multiprocessing.get_context(method)
    import numpy  # noqa: F401  (loaded once here, so forked workers inherit it)

    results: dict[int, FileReport] = {}
    failed: list[int] = []
    done = 0
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = {pool.submit(audit_file, p): i for i, p in enumerate(files)}
        for fut in as_completed(futures):
            i = futures[fut]
            try:
                results[i] = fut.result()
            except Exception:
                failed.append(i)
                continue
            done += 1
            if progress:
                progress(done, len(files))
    # A worker that dies breaks the whole pool, so every file still in flight lands
    # here: retry each alone, and only then decide which ones kill a worker.
    crashed: dict[int, BaseException] = {}
    for i in sorted(failed):
        try:
            with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
                results[i] = pool.submit(audit_file, files[i]).result()
        except Exception as exc:
            crashed[i] = exc
        done += 1
        if progress:
            progress(done, len(files))
    if crashed and not results:
        # Nothing has ever come back: the workers cannot run here at all, which says
        # nothing about the files. Do not call them corrupt.
        exc = next(iter(crashed.values()))
        raise RuntimeError(f"audit worker processes cannot run: {exc!r}") from exc
    for i, exc in crashed.items():
        results[i] = _crashed(files[i], exc)
    return [results[i] for i in range(len(files))]
