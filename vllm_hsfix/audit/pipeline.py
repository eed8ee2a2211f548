"""A whole audit: paths -> files -> per-file pass in parallel -> dataset pass -> report.

:func:`audit_paths` is the library entry point (the command, the tests, the benchmark
and the end-to-end harness call it); :func:`expand_paths` is its first step, also used
by the command to answer "nothing to audit" before any work starts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from .dataset import dataset_pass, prefix_pass
from .format import LOCK_SUFFIX, SUFFIX
from .parallel import ProgressFn, default_workers, run_pool
from .reports import AuditReport


def expand_paths(paths: Iterable[str | os.PathLike[str]]) -> list[str]:
    """Directories give their ``*.safetensors`` files, recursively and sorted; a file
    named explicitly is audited whatever its name (a shell glob may hand us a stray
    file and the user should hear about it), except ``.lock`` companions. Duplicates
    are dropped. Raises ``FileNotFoundError`` for a path that does not exist."""
    out: list[str] = []
    seen: set[str] = set()

    def keep(p: str) -> None:
        real = os.path.realpath(p)
        if real not in seen:
            seen.add(real)
            out.append(p)

    for raw in paths:
        p = os.fspath(raw)
        if os.path.isdir(p):
            found = []
            for root, dirs, names in os.walk(p):
                dirs.sort()
                found += [os.path.join(root, n) for n in names if n.endswith(SUFFIX)]
            for q in sorted(found):
                keep(q)
        elif os.path.exists(p):
            if not p.endswith(LOCK_SUFFIX):
                keep(p)
        else:
            raise FileNotFoundError(f"no such file or directory: {p}")
    return out


def audit_paths(
    paths: Iterable[str | os.PathLike[str]],
    workers: int | None = None,
    progress: ProgressFn | None = None,
) -> AuditReport:
    """Audit files and directories: the per-file pass in parallel, then the dataset pass.

    ``progress(done, total)`` is called after each file. Raises ``FileNotFoundError`` for
    a missing path and ``ValueError`` for ``workers`` < 1."""
    t0 = time.perf_counter()
    files = expand_paths(paths)
    n = default_workers() if workers is None else workers
    if n < 1:
        raise ValueError(f"workers must be >= 1, got {n}")
    n = max(1, min(n, len(files)))
    reports = run_pool(files, n, progress) if files else []
    dataset = dataset_pass(reports) if reports else {}
    if reports:
        dataset["prefix"] = prefix_pass(reports)
    return AuditReport(files=reports, wall_s=time.perf_counter() - t0, workers=n, dataset=dataset)
