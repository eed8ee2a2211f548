"""The audit as a stream of records (``--jsonl``): a ``file`` record per file as it is
judged, an ``update`` per file a dataset check changed, then one ``summary``."""

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
