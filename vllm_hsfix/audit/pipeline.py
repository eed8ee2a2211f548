"""A whole audit: paths -> files -> per-file pass (local pool or Ray) -> dataset pass,
each file's record streamed to ``on_record`` as it is judged."""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from . import parallel, prefix, reports
from .dataset import Findings, Ledger, add_finding, dataset_pass
from .format import LOCK_SUFFIX, SUFFIX
from .parallel import STALL_S, default_workers, run_pool
from .progress import SILENT, Factory
from .reports import CORRUPT, PENDING, AuditReport, FileReport, Problem
from .scan import locked
from .store import State

RecordFn = Callable[[reports.Record], None]


@dataclass(frozen=True)
class Reference:
    """``--reference``: recompute a sample with a transformers forward of the verifier."""

    model_dir: str
    aux_layers: tuple[int, ...]
    sample: str = "0.05"
    dtype: str = "float32"


def expand_paths(paths: Iterable[str | os.PathLike[str]]) -> list[str]:
    """Directories give their ``*.safetensors`` files, recursively and sorted; a file
    named explicitly is audited whatever its name, except ``.lock`` companions; each
    file once. Raises ``FileNotFoundError`` for a path that does not exist."""
    roots = [os.fspath(r) for r in paths]
    found: list[str] = []
    for p in roots:
        try:
            is_dir = stat.S_ISDIR(os.stat(p).st_mode)  # one stat per named path
        except OSError:
            raise FileNotFoundError(f"no such file or directory: {p}") from None
        if is_dir:
            # One directory walked without following links yields each file once.
            below: list[str] = []
            for root, dirs, names in os.walk(p):
                dirs.sort()
                below += [os.path.join(root, n) for n in names if n.endswith(SUFFIX)]
            below.sort()
            found += below
        elif not p.endswith(LOCK_SUFFIX):
            found.append(p)
    return found if len(roots) < 2 else _first_of_each_file(found)


def _first_of_each_file(paths: list[str]) -> list[str]:
    """``paths`` without the later names of a file named more than once (two spellings,
    a link), by (device, inode); a path that cannot be stat'ed by its real path."""
    seen: set[Any] = set()
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            key: Any = (st.st_dev, st.st_ino)
        except OSError:
            key = os.path.realpath(p)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def check_file(path: str | os.PathLike[str]) -> FileReport:
    """The per-file checks on one file, without dataset context (``pending`` while the
    writer holds its lock)."""
    from .scan import audit_file

    p = os.fspath(path)
    return locked(p) or audit_file(p)


def _stats(files: list[str]) -> tuple[Any, Any]:
    """Each file's size and mtime (ns) as two int64 arrays (0, 0 where it is gone)."""
    import numpy as np

    sizes, mtimes = np.zeros(len(files), np.int64), np.zeros(len(files), np.int64)
    for i, p in enumerate(files):
        try:
            st = os.stat(p)
        except OSError:
            continue
        sizes[i], mtimes[i] = st.st_size, st.st_mtime_ns
    return sizes, mtimes


def audit_paths(
    paths: Iterable[str | os.PathLike[str]],
    workers: int | None = None,
    progress: Factory = SILENT,
    *,
    ray: str | bool | None = None,
    state: str | os.PathLike[str] | None = None,
    on_record: RecordFn | None = None,
    keep: bool = True,
    reference: Reference | None = None,
    stall_s: float = STALL_S,
) -> AuditReport:
    """Audit files and directories: the per-file pass in parallel, then the dataset pass.

    ``ray``: ``True`` or an address scans on a Ray cluster; ``state``: a ``--state``
    file; ``on_record``: each record as it is made; ``keep``: keep every full report
    (else only verdicts); ``stall_s``: see :class:`.parallel.Stalled` (0: no bound)."""
    t0 = time.perf_counter()
    files = expand_paths(paths)
    n = default_workers() if workers is None else workers
    if n < 1:
        raise ValueError(f"workers must be >= 1, got {n}")
    run = _Run(files, on_record, keep, State(os.fspath(state)) if state is not None else None)
    run.bar = progress("scan", len(files), int(run.sizes.sum()))
    try:
        todo = run.reuse_state()
        backend = "local"
        if len(todo):
            n, backend = run.scan(todo, n, ray, stall_s)
    finally:
        run.bar.close()
        if run.state is not None:
            run.state.save()
    dataset, findings = run.dataset_pass(progress, reference)
    return run.finish(findings, dataset, t0, n, backend)


class _Run:
    """One audit's files and what the driver keeps of them as they are judged."""

    def __init__(
        self, files: list[str], on_record: RecordFn | None, keep: bool, state: State | None
    ) -> None:
        self.files, self.keep, self.state = files, keep, state
        self.emit = on_record or (lambda r: None)
        self.streaming = on_record is not None
        self.sizes, self.mtimes = _stats(files)
        self.full: list[FileReport | None] = [None] * len(files)
        self.ledger = Ledger(len(files))
        self.prefixes = prefix.Store()
        self.reused = 0
        self.bar: Any = None

    def take(self, i: int, rep: FileReport, cached: bool = False) -> None:
        """File ``i``'s per-file report: streamed, stored, kept for the dataset pass."""
        if self.state is not None and not cached and rep.verdict != PENDING:
            self.state.put(rep, int(self.sizes[i]), int(self.mtimes[i]))
        if self.streaming:
            self.emit(reports.file_record(rep, cached))
        if rep.verdict != PENDING:
            self.ledger.put(i, rep)
            self.prefixes.add(i, rep.prefix)
        rep.prefix = None  # the store holds it now
        if self.keep or rep.verdict == PENDING:
            self.full[i] = rep
        self.bar.update(1, rep.bytes)

    def reuse_state(self) -> Any:
        """Take the files ``--state`` supplies; the indices of those left to scan."""
        import numpy as np

        fresh = np.ones(len(self.files), dtype=bool)
        if self.state is None:
            return np.flatnonzero(fresh)
        for i, p in enumerate(self.files):
            cached = self.state.lookup(p, int(self.sizes[i]), int(self.mtimes[i]))
            if cached is None:
                continue
            fresh[i] = False
            if (pending := locked(p)) is not None:
                self.take(i, pending)
            else:
                self.reused += 1
                self.take(i, cached, cached=True)
        return np.flatnonzero(fresh)

    def scan(self, todo: Any, n: int, ray: str | bool | None, stall_s: float) -> tuple[int, str]:
        """The per-file pass over files ``todo``, here or on Ray: (workers, backend)."""
        paths_todo = [self.files[i] for i in todo.tolist()]
        todo_sizes = self.sizes[todo]

        def on_result(k: int, rep: FileReport) -> None:
            self.take(int(todo[k]), rep)

        if ray is None or ray is False:
            n = max(1, min(n, len(todo)))
            run_pool(paths_todo, todo_sizes, n, on_result, stall_s)
            return n, "local"
        # Ray's driver prints the cluster's notices on stdout, where --jsonl - may be.
        with contextlib.redirect_stdout(sys.stderr):
            cluster = parallel.ray_connect(None if ray is True else str(ray))
            try:
                n = parallel.run_ray(cluster, paths_todo, todo_sizes, on_result, stall_s)
            finally:
                cluster.shutdown()
        return n, "ray"

    def dataset_pass(
        self, progress: Factory, reference: Reference | None
    ) -> tuple[dict[str, Any], Findings]:
        """The cross-file checks over the judged files."""
        import numpy as np

        judged = self.ledger.judged()
        findings: Findings = {}
        if not len(judged):
            self.prefixes.close()
            return {}, findings
        bar = progress("norms", len(judged))
        dataset = dataset_pass(self.ledger, judged, findings)
        bar.update(len(judged))
        bar.close()
        bar = progress("prefix", len(judged))
        positions = np.full(len(self.files), -1, dtype=np.int64)
        positions[judged] = np.arange(len(judged))
        with self.prefixes:  # its temporary files go now
            result = prefix.check(self.prefixes, positions, len(judged), bar.update)
        bar.close()
        for k, finding in sorted(result.findings.items()):
            problem = Problem("prefix_mismatch", CORRUPT, prefix.describe(finding))
            add_finding(findings, self.ledger, int(judged[k]), problem)
        dataset["prefix"] = result.summary(len(judged))
        if reference is not None:
            _reference_pass(self.files, self.ledger, judged, findings, reference, dataset, progress)
        return dataset, findings

    def finish(
        self, findings: Findings, dataset: dict[str, Any], t0: float, n: int, backend: str
    ) -> AuditReport:
        """The dataset checks' updates streamed and applied; the report; the summary."""
        final = self.ledger.verdicts()
        full = self.full
        for i, problems in sorted(findings.items()):
            if full[i] is not None:
                for pr in problems:
                    full[i].add(pr.code, pr.severity, pr.detail)  # type: ignore[union-attr]
            self.emit(reports.update_record(self.files[i], final[i], problems))  # type: ignore[arg-type]
        verdicts = [
            (p, v if v is not None else full[i].verdict)  # type: ignore[union-attr]
            for i, (p, v) in enumerate(zip(self.files, final, strict=True))
        ]
        report = AuditReport(
            files=[r for r in full if r is not None] if self.keep else [],
            wall_s=time.perf_counter() - t0,
            workers=n,
            dataset=dataset,
            backend=backend,
            reused=self.reused,
            verdicts=verdicts,
            total_bytes=int(self.sizes.sum()),
        )
        if self.state is not None and self.state.note:
            report.dataset["state_note"] = self.state.note
        self.emit(reports.summary_record(report))
        return report


def _reference_pass(
    files: list[str],
    ledger: Ledger,
    judged: Any,
    findings: Findings,
    ref: Reference,
    dataset: dict,
    progress: Factory,
) -> None:
    """``--reference``: recompute a sample; mismatching files become corrupt."""
    from . import reference

    readable = judged[ledger.n_tokens[judged] > 0].tolist()
    if not readable:
        return
    paths = [files[i] for i in readable]
    bar = progress("reference", len(reference.sample(paths, ref.sample)))
    try:
        wrong, summary = reference.check(
            paths, ref.model_dir, list(ref.aux_layers), ref.sample, ref.dtype, bar.update
        )
    finally:
        bar.close()
    index = dict(zip(paths, readable, strict=True))
    for path, detail in wrong.items():
        add_finding(findings, ledger, index[path], Problem("reference_mismatch", CORRUPT, detail))
    dataset["reference"] = summary
