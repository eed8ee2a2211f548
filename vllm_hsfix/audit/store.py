"""What must outlive a run, as JSON Lines (never pickle): appended and flushed a line
at a time, read back skipping a torn last line, rewritten atomically."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import IO, Any

Record = dict[str, Any]


def dumps(record: Record) -> str:
    """One record as one line (no newline), compact."""
    return json.dumps(record, separators=(",", ":"))


def read(path: str | os.PathLike[str]) -> list[Record]:
    """Every whole record of ``path`` in order ([] when it does not exist); a line that
    is not a JSON object (the last one cut short by a killed writer) is skipped."""
    try:
        with open(path, encoding="utf-8") as f:
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
    p = os.fspath(path)
    tmp = f"{p}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for r in records:
                f.write((r if isinstance(r, str) else dumps(r)) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def append(path: str | os.PathLike[str], record: Record, sync: bool = False) -> None:
    """Append one record to ``path`` (``sync``: fsync it before returning, for a record
    that says a file is in place)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(dumps(record) + "\n")
        f.flush()
        if sync:
            os.fsync(f.fileno())


class Appender:
    """Appends records to ``path`` one line at a time, flushed as written (``fresh``:
    start the file over instead of appending to what is there)."""

    def __init__(self, path: str | os.PathLike[str], fresh: bool = False) -> None:
        self.path = os.fspath(path)
        self.fresh = fresh
        self._out: IO[str] | None = None

    def append(self, record: Record | str) -> None:
        if self._out is None:
            self._out = open(self.path, "w" if self.fresh else "a", encoding="utf-8")  # noqa: SIM115
        self._out.write((record if isinstance(record, str) else dumps(record)) + "\n")
        self._out.flush()

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
