"""Judging many files in batches of consecutive files over a stdlib process pool or Ray
tasks: a worker that dies is pinned on its file, and a run where nothing comes back for
``stall_s`` seconds ends."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from . import decode
from .prefix import single_blas_thread
from .reports import CORRUPT, FileReport
from .scan import audit_file, locked

if TYPE_CHECKING:
    from concurrent.futures import Future

ResultFn = Callable[[int, FileReport], None]

# A task holds at most this many files or bytes; at least TASKS_PER_WORKER tasks per
# worker while files last, so the pool stays balanced.
MAX_BATCH_FILES = 64
MAX_BATCH_BYTES = 256 * 1024 * 1024
TASKS_PER_WORKER = 4
# No batch back for this long: a read that never returns (a hung filesystem, a FIFO).
STALL_S = 600.0
NAMED_BATCHES = 3  # batches a Stalled message names


class Stalled(RuntimeError):
    """No batch came back for ``stall_s`` seconds: the run ends naming the batches out."""


def stalled(out: Sequence[range], files: Sequence[str], stall_s: float) -> Stalled:
    """The :class:`Stalled` for batches ``out``, each named by its first and last file."""
    named = [
        files[b[0]] if len(b) == 1 else f"{len(b)} files {files[b[0]]} ... {files[b[-1]]}"
        for b in out[:NAMED_BATCHES]
    ]
    more = f"; and {len(out) - NAMED_BATCHES} more" if len(out) > NAMED_BATCHES else ""
    return Stalled(
        f"no batch of files came back for {stall_s:g} s (--stall-timeout): "
        f"{len(out)} still out, not judged: {'; '.join(named)}{more}. A read that never "
        "returns (a hung filesystem, a FIFO or device file?); --state keeps what was judged"
    )


def default_workers() -> int:
    """min(4, CPUs): past a few processes the scan is bound by the disk, not the CPU."""
    return max(1, min(4, os.cpu_count() or 1))


def batches(sizes: Sequence[int], workers: int) -> list[range]:
    """File indices cut into consecutive tasks (see ``MAX_BATCH_*``), each a range."""
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


def audit_files(paths: Sequence[str]) -> list[FileReport]:
    """Each file's per-file report, in order (``pending`` while its writer holds it)."""
    return [locked(p) or audit_file(p) for p in paths]


def run_batch(paths: list[str], total_bytes: int = 0) -> list[FileReport]:
    """One task: judge each file. ``total_bytes``: the whole audit's size, which decides
    on the compiled fp8 kernel (:func:`.decode.allow`)."""
    if total_bytes:
        decode.allow(total_bytes)
    with single_blas_thread():  # parallel workers must not spin BLAS threads
        return audit_files(paths)


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

    # fork is fast and needs no importable __main__, but can deadlock a threaded process.
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        method = "fork"
    else:
        method = "forkserver" if "forkserver" in methods else "spawn"
    return multiprocessing.get_context(method)


def run_pool(
    files: list[str],
    sizes: Sequence[int],
    workers: int,
    on_result: ResultFn,
    stall_s: float = STALL_S,
) -> None:
    """Audit ``files`` in worker processes; ``on_result(index, report)`` as each is
    judged. A worker killed mid-file breaks the pool: the files in flight are retried
    one per fresh process, so the crash is pinned on its file. Raises :class:`Stalled`
    when nothing comes back for ``stall_s`` seconds (0: no bound)."""
    ctx = _context()
    import numpy  # loaded once here, so forked workers inherit it (and the kernel)

    total = int(numpy.asarray(sizes).sum())
    if decode.is_fp8(files[0]):  # an fp8 dataset: the kernel is loaded before the fork
        decode.enable(total)
    failed, got = _first_pass(ctx, files, sizes, workers, on_result, total, stall_s)
    crashed: dict[int, BaseException] = {}
    for i in sorted(failed):
        try:
            rep = _alone(ctx, files, i, total, stall_s)
        except Stalled:
            raise
        except Exception as exc:
            crashed[i] = exc
            continue
        got += 1
        on_result(i, rep)
    if crashed and not got:
        # Nothing ever came back: the workers cannot run here, which says nothing of files.
        exc = next(iter(crashed.values()))
        raise RuntimeError(f"audit worker processes cannot run: {exc!r}") from exc
    for i, exc in crashed.items():
        on_result(i, crashed_report(files[i], exc))


def _first_pass(
    ctx: Any,
    files: list[str],
    sizes: Sequence[int],
    workers: int,
    on_result: ResultFn,
    total: int,
    stall_s: float,
) -> tuple[list[int], int]:
    """Every batch through one pool: (the files of batches that failed, files judged)."""
    from concurrent.futures import ProcessPoolExecutor

    failed: list[int] = []
    got = 0
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = {
            pool.submit(run_batch, [files[i] for i in batch], total): batch
            for batch in batches(sizes, workers)
        }
        for batch, reps in _as_done(futures, lambda: _abandon(pool), files, stall_s):
            if isinstance(reps, Exception):
                failed += batch
                continue
            for i, rep in zip(batch, reps, strict=True):
                got += 1
                on_result(i, rep)
    return failed, got


def _as_done(
    pending: dict[Future, range], stop: Callable[[], None], files: Sequence[str], stall_s: float
) -> Iterator[tuple[range, Any]]:
    """(batch, its reports or its task's exception) as each finishes (pool or Ray);
    ``stop()`` and :class:`Stalled` when none does in ``stall_s``."""
    from concurrent.futures import FIRST_COMPLETED, wait

    while pending:
        done, _ = wait(pending, timeout=stall_s or None, return_when=FIRST_COMPLETED)
        if not done:
            out = sorted(pending.values(), key=lambda b: b.start)
            stop()
            raise stalled(out, files, stall_s)
        for fut in done:
            batch = pending.pop(fut)
            try:
                got = fut.result()
            except Exception as exc:
                got = exc
            yield batch, got


def _alone(ctx: Any, files: list[str], i: int, total: int, stall_s: float) -> FileReport:
    """File ``i`` judged in a fresh process of its own (raises what killed it)."""
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        futures = {pool.submit(run_batch, [files[i]], total): range(i, i + 1)}
        _, got = next(_as_done(futures, lambda: _abandon(pool), files, stall_s))
    if isinstance(got, Exception):
        raise got
    return got[0]


def _abandon(pool: Any) -> None:
    """Kill a pool's workers (one is stuck in a read), so leaving it does not wait."""
    # ``_processes``: the executor's map of its workers (3.14 adds terminate_workers()).
    for _ in range(3):  # again while one lives on (slow to die, or started meanwhile)
        procs = [p for p in (getattr(pool, "_processes", None) or {}).values() if p.is_alive()]
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.kill()
        for proc in procs:  # reaped: none outlives the run
            with contextlib.suppress(Exception):
                proc.join(timeout=10)
    pool.shutdown(wait=False, cancel_futures=True)


# ``audit --ray [ADDRESS]``: the same batches as Ray tasks; the dataset pass stays on the
# driver, so the verdicts are the local run's.
RAY_HINT = "pip install 'vllm-hsfix[ray]'"
# Ray re-runs a task whose worker died this many times before giving up on it.
RAY_RETRIES = 3


def ray_missing() -> str | None:
    """The one-line message when Ray is not installed, else None."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return f"vllm-hsfix audit --ray needs Ray, which is not installed here: {RAY_HINT}"
    return None


def ray_connect(address: str | None) -> Any:
    """Join the cluster at ``address`` (``None``: ``RAY_ADDRESS`` or a local one),
    shipping this package."""
    import ray

    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # vllm_hsfix
    ray.init(
        address=address or None,
        runtime_env={"py_modules": [package_dir]},
        logging_level="ERROR",
        log_to_driver=False,
    )
    return ray


def run_ray(
    ray: Any,
    files: list[str],
    sizes: Sequence[int],
    on_result: ResultFn,
    stall_s: float = STALL_S,
) -> int:
    """Scan ``files`` as Ray tasks (a task whose worker dies is retried, then split into
    one task per file); ``on_result(index, report)`` per file. Returns the cluster's
    CPUs. Raises :class:`.parallel.Stalled` when no task finishes for ``stall_s`` s."""
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    total = int(sum(sizes))  # the workers decide on the compiled kernel from it
    task = ray.remote(num_cpus=1, max_retries=RAY_RETRIES)(run_batch)
    refs = {task.remote([files[i] for i in b], total): b for b in batches(sizes, cpus)}
    singles: list[int] = []
    for batch, reps in _as_done(*_ray_futures(ray, refs), files, stall_s):
        if isinstance(reps, Exception):
            singles += batch  # retries spent: find the file, one task per file
            continue
        for i, rep in zip(batch, reps, strict=True):
            on_result(i, rep)
    alone = ray.remote(num_cpus=1, max_retries=1)(run_batch)
    refs = {alone.remote([files[i]], total): range(i, i + 1) for i in singles}
    for batch, reps in _as_done(*_ray_futures(ray, refs), files, stall_s):
        i = batch[0]
        on_result(i, crashed_report(files[i], reps) if isinstance(reps, Exception) else reps[0])
    return cpus


def _ray_futures(ray: Any, refs: dict[Any, range]) -> tuple[dict[Future, range], Callable]:
    """Ray tasks as futures for :func:`_as_done`, and what cancels those still out."""

    def cancel() -> None:
        for ref in refs:
            with contextlib.suppress(Exception):  # finished meanwhile: nothing to cancel
                ray.cancel(ref, force=True)

    return {ref.future(): batch for ref, batch in refs.items()}, cancel
