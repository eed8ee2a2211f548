"""The audit as a stream of records: what ``--jsonl`` writes and ``--json`` is built from.

One JSON object per line, in this order:

* ``{"type": "file", ...}`` for each file as soon as the per-file checks have judged it
  (the :class:`.reports.FileReport` fields, ``format`` among them; ``cached`` when
  ``--state`` supplied it instead of a scan; ``verdict`` ``pending`` for a file still
  locked by its writer, ``unsupported`` for a format the audit does not know);
* ``{"type": "update", "path", "verdict", "problems"}`` for each file the dataset-level
  checks (shape majority, norms, shared prefixes, ``--reference``) changed: the new
  findings and the file's final verdict;
* one ``{"type": "summary", "schema", "totals", "regenerate", "suspect", "pending",
  "unsupported", "dataset"}`` at the end (the lists name only files, so the summary of 500k files is
  tens of MB, not the whole report).

A consumer that keeps the last verdict per path has every file's final verdict.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import IO, Any

from .reports import PENDING, SCHEMA, SUSPECT, UNSUPPORTED, AuditReport, FileReport, Problem

FILE, UPDATE, SUMMARY = "file", "update", "summary"
Record = dict[str, Any]


def file_record(rep: FileReport, cached: bool = False) -> Record:
    return {"type": FILE, **rep.to_dict(), "cached": cached}


def update_record(path: str, verdict: str, problems: list[Problem]) -> Record:
    return {
        "type": UPDATE,
        "path": path,
        "verdict": verdict,
        "problems": [asdict(p) for p in problems],
    }


def summary_record(report: AuditReport) -> Record:
    return {
        "type": SUMMARY,
        "schema": SCHEMA,
        "totals": report.totals(),
        "regenerate": report.regenerate,
        SUSPECT: report.suspect,
        PENDING: report.paths(PENDING),
        UNSUPPORTED: report.paths(UNSUPPORTED),
        "dataset": report.dataset,
    }


class JsonlWriter:
    """Records to a file or (``-``) stdout, one line each, flushed as written so that a
    pipeline reading the other end sees each file as it is judged."""

    def __init__(self, dest: str) -> None:
        self.dest = dest
        self.out: IO[str] = sys.stdout if dest == "-" else open(dest, "w", encoding="utf-8")  # noqa: SIM115

    def __call__(self, record: Record) -> None:
        self.out.write(json.dumps(record, separators=(",", ":")) + "\n")
        self.out.flush()

    def close(self) -> None:
        if self.out is not sys.stdout:
            self.out.close()
