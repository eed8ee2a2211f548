"""``audit --ray [ADDRESS]``: the per-file scan as Ray tasks over the local pool's
batches; the dataset pass stays on the driver, so the verdicts are the local run's."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

from .parallel import STALL_S, ResultFn, batches, crashed_report, run_batch, stalled

INSTALL_HINT = "pip install 'vllm-hsfix[ray]'"
# Ray re-runs a task whose worker died this many times before giving up on it.
MAX_RETRIES = 3


def missing_dependency() -> str | None:
    """The one-line message when Ray is not installed, else None."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return f"vllm-hsfix audit --ray needs Ray, which is not installed here: {INSTALL_HINT}"
    return None


def _package_dir() -> str:
    """The ``vllm_hsfix`` directory this module belongs to (shipped to the workers)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def connect(address: str | None) -> Any:
    """Join the cluster at ``address`` (``None``: ``RAY_ADDRESS`` or a local one),
    shipping this package."""
    import ray

    ray.init(
        address=address or None,
        runtime_env={"py_modules": [_package_dir()]},
        logging_level="ERROR",
        log_to_driver=False,
    )
    return ray


def cluster_cpus(ray: Any) -> int:
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


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
    cpus = cluster_cpus(ray)
    total = int(sum(sizes))  # the workers decide on the compiled kernel from it
    task = ray.remote(num_cpus=1, max_retries=MAX_RETRIES)(run_batch)
    pending = {task.remote([files[i] for i in b], total): b for b in batches(sizes, cpus)}
    singles: list[int] = []
    for batch, reps in _as_done(ray, pending, files, stall_s):
        if isinstance(reps, Exception):
            singles += batch  # retries spent: find the file, one task per file
            continue
        for i, rep in zip(batch, reps, strict=True):
            on_result(i, rep)
    alone = ray.remote(num_cpus=1, max_retries=1)(run_batch)
    pending = {alone.remote([files[i]], total): range(i, i + 1) for i in singles}
    for batch, reps in _as_done(ray, pending, files, stall_s):
        i = batch[0]
        on_result(i, crashed_report(files[i], reps) if isinstance(reps, Exception) else reps[0])
    return cpus


def _as_done(
    ray: Any, pending: dict[Any, range], files: Sequence[str], stall_s: float
) -> Iterator[tuple[range, Any]]:
    """(batch, its reports or its task's exception) as each task finishes; the tasks
    still out cancelled and :class:`.parallel.Stalled` raised when none does in time."""
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=stall_s or None)
        if not done:
            out = sorted(pending.values(), key=lambda b: b.start)
            for ref in pending:
                with contextlib.suppress(Exception):  # finished meanwhile: nothing to cancel
                    ray.cancel(ref, force=True)
            raise stalled(out, files, stall_s)
        for ref in done:
            batch = pending.pop(ref)
            try:
                got = ray.get(ref)
            except Exception as exc:
                got = exc
            yield batch, got
