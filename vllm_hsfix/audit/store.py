"""What must outlive a run, as JSON Lines (never pickle): appended and flushed a line
at a time, read back skipping a torn last line, rewritten atomically. Used by repair's
journal and by ``audit --state`` (:class:`State`: per-file results kept by path, size
and mtime, so a rerun scans only new or changed files)."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterable
from typing import Any

from .._version import __version__
from . import outfiles
from .prefix import PrefixData
from .reports import PENDING, VERDICTS, FileReport

Record = dict[str, Any]


def dumps(record: Record) -> str:
    """One record as one line (no newline), compact."""
    return json.dumps(record, separators=(",", ":"))


def read(path: str | os.PathLike[str]) -> list[Record]:
    """Every whole record of ``path`` in order ([] when it does not exist); a line that
    is not a JSON object (the last one cut short by a killed writer) is skipped."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def rewrite(path: str | os.PathLike[str], records: Iterable[Record | str]) -> None:
    """Replace ``path`` with ``records`` (dicts, or lines already made by :func:`dumps`)
    through a temporary file, fsync and rename: never a half-written file."""
    lines = ((r if isinstance(r, str) else dumps(r)) + "\n" for r in records)
    outfiles.write_lines(os.fspath(path), lines)


def append(path: str | os.PathLike[str], record: Record, sync: bool = False) -> None:
    """Append one record to ``path`` (``sync``: fsync it before returning, for a record
    that says a file is in place)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(dumps(record) + "\n")
        f.flush()
        if sync:
            os.fsync(f.fileno())


# Bump when a per-file check changes what it reports: old states are then rescanned.
# 2: fp8 files de-quantized (were corrupt), unknown formats ``unsupported``.
# 3: a hidden_states that is not 3-D, token_ids not 1-D: ``unsupported`` (were corrupt).
CHECKS_REVISION = 3
_HEADER = {"kind": outfiles.STATE_KIND, "version": __version__, "checks": CHECKS_REVISION}
# Findings that say nothing lasting about the file.
TRANSIENT = frozenset({"unreadable"})


_ARRAYS = ("sketches", "norms", "sound")  # PrefixData's numpy fields


def _prefix_out(p: PrefixData | None) -> dict[str, Any] | None:
    """A prefix contribution as JSON: its arrays as dtype, shape and base64 bytes."""
    if p is None:
        return None
    out: dict[str, Any] = {"token_ids": list(p.token_ids), "shape_key": list(p.shape_key)}
    for name in _ARRAYS:
        a = getattr(p, name)
        out[name] = {
            "dtype": str(a.dtype),
            "shape": list(a.shape),
            "b64": base64.b64encode(a).decode(),
        }
    return out


def _prefix_in(d: dict[str, Any] | None) -> PrefixData | None:
    """The inverse of :func:`_prefix_out`."""
    import numpy as np

    if d is None:
        return None
    arrays = {
        name: np.frombuffer(base64.b64decode(d[name]["b64"]), dtype=d[name]["dtype"])
        .reshape(d[name]["shape"])
        .copy()
        for name in _ARRAYS
    }
    n_aux, hidden = d["shape_key"]
    return PrefixData(tuple(d["token_ids"]), shape_key=(int(n_aux), int(hidden)), **arrays)


class State:
    """The per-file results of earlier runs, and the lines of this one."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.note = ""  # why an existing state was not used, for the run's output
        self._old: dict[str, Record] = {}
        self._new: dict[str, Record | str] = {}
        outfiles.claim(path, "--state", outfiles.is_state, "an audit state file")
        records = read(path)
        if records and records[0] != _HEADER:
            self.note = (
                f"--state {self.path}: written by another vllm-hsfix version or checks "
                "revision: every file is scanned again"
            )
            records = []
        self._old = {r["path"]: r for r in records[1:] if isinstance(r.get("path"), str)}
        # Appended a line at a time, flushed as written: a killed audit keeps its work.
        self._out = open(path, "a" if self._old else "w", encoding="utf-8")  # noqa: SIM115
        if not self._old:
            self._write(dumps(_HEADER))

    def _write(self, line: str) -> None:
        self._out.write(line + "\n")
        self._out.flush()

    def lookup(self, path: str, size: int, mtime_ns: int) -> FileReport | None:
        """The stored per-file report (with its prefix sketch), if the file is unchanged."""
        d = self._old.get(path)
        if d is None or d.get("size") != size or d.get("mtime_ns") != mtime_ns:
            return None
        try:
            rep = FileReport.from_dict(d["report"])
            rep.prefix = _prefix_in(d.get("prefix"))
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return None  # a line this version cannot read back: the file is scanned again
        if rep.verdict not in VERDICTS or rep.verdict == PENDING:
            return None
        self._new[path] = d  # already on disk: kept at save(), not appended again
        return rep

    def put(self, rep: FileReport, size: int, mtime_ns: int) -> None:
        """Store a freshly scanned file's per-file results (before any dataset check)."""
        if TRANSIENT & set(rep.codes()):
            return
        line = dumps(
            {
                "path": rep.path,
                "size": size,
                "mtime_ns": mtime_ns,
                "report": rep.to_dict(),
                "prefix": _prefix_out(rep.prefix),
            }
        )
        self._new[rep.path] = line
        self._write(line)

    def save(self) -> None:
        """Rewrite the state with this run's files only (deleted files drop out)."""
        self._out.close()
        rewrite(self.path, [_HEADER, *self._new.values()])
