"""How a run is shown: the text summary (per check, the first ``--show`` files by
path), ``--list`` and the CSV; the text is built from the records (:class:`Digest`)."""

from __future__ import annotations

import csv
import heapq
import io
import json
import os
import sys
from collections import Counter
from typing import IO

from . import outfiles
from .format import FORMATS
from .reports import (
    CORRUPT,
    FILE,
    OK,
    PENDING,
    SUSPECT,
    UNSUPPORTED,
    UPDATE,
    AuditReport,
    Record,
    file_record,
)

DEFAULT_SHOW = 5
LIST_KINDS = {
    CORRUPT: (CORRUPT,),
    SUSPECT: (SUSPECT,),
    "bad": (CORRUPT, SUSPECT),
    PENDING: (PENDING,),
    UNSUPPORTED: (UNSUPPORTED,),
}
_RANK = {CORRUPT: 0, UNSUPPORTED: 1, SUSPECT: 2, PENDING: 3}


class Digest:
    """Per check (code, severity): how many files it flagged and the first ``show`` of
    them by path (``None``: all); and the provenance stamps seen. Fed the records."""

    def __init__(self, show: int | None = DEFAULT_SHOW) -> None:
        self.show = show
        self.files: Counter[tuple[str, str]] = Counter()
        # Per check: (path, detail) candidates, trimmed to the `show` smallest paths.
        self.examples: dict[tuple[str, str], list[tuple[str, str]]] = {}
        self.stamps: Counter[str] = Counter()
        self.stamped = 0
        self.formats: Counter[str] = Counter()  # files read as each known layout

    def __call__(self, record: Record) -> None:
        if record["type"] not in (FILE, UPDATE):
            return
        seen: set[tuple[str, str]] = set()
        for p in record["problems"]:
            key = (p["code"], p["severity"])
            if key in seen:  # one file, several findings of one check: one example
                continue
            seen.add(key)
            self.files[key] += 1
            self._example(key, record["path"], p["detail"])
        if record["type"] == FILE and record.get("format"):
            self.formats[record["format"]] += 1
        prov = record.get("provenance")
        if record["type"] == FILE and prov:
            self.stamped += 1
            self.stamps[
                f"vllm-hsfix {prov.get('vllm_hsfix.version', '?')} on vLLM "
                f"{prov.get('vllm_hsfix.vllm', '?')} [{prov.get('vllm_hsfix.patches', '?')}]"
            ] += 1

    def _example(self, key: tuple[str, str], path: str, detail: str) -> None:
        heap = self.examples.setdefault(key, [])
        heap.append((path, detail))
        # Amortised: let the list grow to about twice `show`, then keep the smallest.
        if self.show is not None and len(heap) > 2 * self.show + 16:
            heap[:] = heapq.nsmallest(self.show, heap)

    @classmethod
    def of(cls, report: AuditReport, show: int | None = DEFAULT_SHOW) -> Digest:
        """The digest of a finished run whose reports were kept."""
        digest = cls(show)
        for f in report.files:
            digest(file_record(f))
        return digest

    def first(self, key: tuple[str, str]) -> list[tuple[str, str]]:
        ex = sorted(self.examples.get(key, []))
        return ex if self.show is None else ex[: self.show]


def format_human(report: AuditReport, digest: Digest | None = None) -> str:
    """The summary, then per check its count and first files, then the result line.
    Without ``digest``, it is made from the report's kept files."""
    digest = digest if digest is not None else Digest.of(report)
    t = report.totals()
    where = f"{t['workers']} CPUs on Ray" if report.backend == "ray" else f"{t['workers']} workers"
    lines = [
        f"audited {t['files']} files, {t['bytes'] / 1e9:.3f} GB in {t['wall_s']:.2f} s "
        f"({t['gb_per_s']:.3f} GB/s, {t['files_per_s']:.1f} files/s, {where})",
        f"  ok {t[OK]}   suspect {t[SUSPECT]}   corrupt {t[CORRUPT]}"
        + (f"   unsupported {t[UNSUPPORTED]}" if t[UNSUPPORTED] else "")
        + (f"   pending {t[PENDING]}" if t[PENDING] else ""),
    ]
    for fmt, n in sorted(digest.formats.items()):
        lines.append(f"  format {fmt}: {n} file{'s' if n != 1 else ''}, {FORMATS.get(fmt, fmt)}")
    if report.reused:
        lines.append(f"  {report.reused} files unchanged since --state was written: not rescanned")
    keys = sorted(digest.files, key=lambda k: (_RANK.get(k[1], 3), -digest.files[k], k[0]))
    for code, severity in keys:
        n = digest.files[(code, severity)]
        lines.append(f"{code} ({severity}): {n} file{'s' if n != 1 else ''}")
        shown = digest.first((code, severity))
        lines += [f"  {path}: {detail}" for path, detail in shown]
        if len(shown) < n:
            kind = severity if severity in LIST_KINDS else "bad"
            lines.append(f"  ... {n - len(shown)} more (--show all, or --list {kind} FILE)")
    pre = report.dataset.get("prefix")
    if pre:
        lines.append(
            f"  shared prefixes: {pre['files_checked']} of {t['files']} files share a prompt "
            f"prefix with another and were cross-checked on their first {pre['positions']} "
            f"rows; {pre['files_flagged']} disagree ({pre['groups_without_consensus']} groups "
            "without a consensus)"
        )
    if digest.stamped:
        kinds = "; ".join(sorted(digest.stamps))
        lines.append(f"  provenance: {digest.stamped} of {t['files']} files made with {kinds}")
    else:
        lines.append(f"  provenance: none of {t['files']} files carry vllm-hsfix metadata")
    if t[CORRUPT]:
        lines.append(f"regenerate: {t[CORRUPT]} corrupt files (--list corrupt FILE lists them)")
    if t[SUSPECT]:
        lines.append(f"look at: {t[SUSPECT]} suspect files (--list suspect FILE lists them)")
    if t[UNSUPPORTED]:
        n = t[UNSUPPORTED]
        lines.append(
            f"not judged: {n} file{'s' if n != 1 else ''} in a format the audit does not "
            "know (--list unsupported FILE lists them)"
        )
    if t[CORRUPT]:
        lines.append("result: CORRUPT files found (exit 1)")
    elif t[UNSUPPORTED]:
        lines.append("result: no corrupt files; unsupported files were not judged (exit 0)")
    elif t[SUSPECT]:
        lines.append("result: no corrupt files; suspect files listed above (exit 0)")
    elif t[PENDING]:
        lines.append("result: no bad files; pending files not judged yet (exit 0)")
    else:
        lines.append("result: all files ok")
    return "\n".join(lines)


def write_list(report: AuditReport, kind: str, dest: str) -> None:
    """``--list KIND DEST``: one path per line, nothing else (``-``: stdout)."""
    wanted = LIST_KINDS[kind]
    text = "".join(f"{p}\n" for p, v in report.verdicts if v in wanted)
    if dest == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        outfiles.write_lines(dest, [text])


CSV_FIELDS = [
    "path",
    "verdict",
    "bytes",
    "dtype",
    "format",
    "n_tokens",
    "n_aux",
    "hidden",
    "n_token_ids",
    "token_mismatch",
    "zero_rows",
    "nan_count",
    "inf_count",
    "duplicate_rows",
    "near_zero_rows",
    "codes",
    "reason",
    "provenance",
]


def write_csv(report: AuditReport, dest: str | os.PathLike[str] | IO[str]) -> None:
    """One row per file, for spreadsheets and ``pandas.read_csv`` (a path: written
    whole, through a temporary file)."""
    if isinstance(dest, (str, os.PathLike)):
        out = io.StringIO()
        write_csv(report, out)
        outfiles.write_lines(os.fspath(dest), [out.getvalue()])
        return
    w = csv.DictWriter(dest, fieldnames=CSV_FIELDS)
    w.writeheader()
    for f in report.files:
        d = {k: getattr(f, k) for k in CSV_FIELDS if hasattr(f, k)}
        d["codes"] = " ".join(f.codes())
        d["reason"] = f.reason()
        d["provenance"] = " ".join(f"{k}={v}" for k, v in sorted(f.provenance.items()))
        w.writerow(d)


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
