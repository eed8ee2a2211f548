"""How a report is shown: the progress bar, the human summary and the CSV file.

``--json`` needs nothing here: it is :meth:`.reports.AuditReport.to_dict` as is.
"""

from __future__ import annotations

import csv
import os
import sys
import time
from typing import IO

from .reports import CORRUPT, OK, SUSPECT, AuditReport


class ProgressBar:
    """``\\r[#####     ] 123/456 files`` on a stream, redrawn at most 10 times a second."""

    def __init__(self, stream: IO[str] | None = None, width: int = 30) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self._last = 0.0
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        filled = self.width * done // max(total, 1)
        bar = "#" * filled + " " * (self.width - filled)
        self.stream.write(f"\r[{bar}] {done}/{total} files")
        self._drawn = True
        if done >= total:
            self.close()
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line so what follows starts clean."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def format_human(report: AuditReport) -> str:
    """Summary first, then one line per file that is not ok, with its reasons."""
    t = report.totals()
    lines = [
        f"audited {t['files']} files, {t['bytes'] / 1e9:.3f} GB in {t['wall_s']:.2f} s "
        f"({t['gb_per_s']:.3f} GB/s, {t['files_per_s']:.1f} files/s, {t['workers']} workers)",
        f"  ok {t[OK]}   suspect {t[SUSPECT]}   corrupt {t[CORRUPT]}",
    ]
    bad = [f for f in report.files if f.verdict != OK]
    for f in sorted(bad, key=lambda f: (f.verdict != CORRUPT, f.path)):
        lines.append(f"{f.verdict.upper():<8} {f.path}")
        lines += [f"         {p.code}: {p.detail}" for p in f.problems]
    pre = report.dataset.get("prefix")
    if pre:
        lines.append(
            f"  shared prefixes: {pre['files_checked']} of {t['files']} files share a prompt "
            f"prefix with another and were cross-checked on their first {pre['positions']} "
            f"rows; {pre['files_flagged']} disagree ({pre['groups_without_consensus']} groups "
            "without a consensus)"
        )
    stamped = [f for f in report.files if f.provenance]
    if stamped:
        kinds = sorted(
            {
                f"vllm-hsfix {f.provenance.get('vllm_hsfix.version', '?')} on vLLM "
                f"{f.provenance.get('vllm_hsfix.vllm', '?')} "
                f"[{f.provenance.get('vllm_hsfix.patches', '?')}]"
                for f in stamped
            }
        )
        lines.append(
            f"  provenance: {len(stamped)} of {t['files']} files made with " + "; ".join(kinds)
        )
    else:
        lines.append(f"  provenance: none of {t['files']} files carry vllm-hsfix metadata")
    if bad:
        lines.append(f"regenerate: {len(bad)} files (corrupt or suspect; --json lists them)")
    if t[CORRUPT]:
        lines.append("result: CORRUPT files found (exit 1)")
    elif t[SUSPECT]:
        lines.append("result: no corrupt files; suspect files listed above (exit 0)")
    else:
        lines.append("result: all files ok")
    return "\n".join(lines)


CSV_FIELDS = [
    "path",
    "verdict",
    "bytes",
    "dtype",
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
    """One row per file, for spreadsheets and ``pandas.read_csv``."""

    def rows(out: IO[str]) -> None:
        w = csv.DictWriter(out, fieldnames=CSV_FIELDS)
        w.writeheader()
        for f in report.files:
            d = {k: getattr(f, k) for k in CSV_FIELDS if hasattr(f, k)}
            d["codes"] = " ".join(f.codes())
            d["reason"] = f.reason()
            d["provenance"] = " ".join(f"{k}={v}" for k, v in sorted(f.provenance.items()))
            w.writerow(d)

    if isinstance(dest, (str, os.PathLike)):
        with open(dest, "w", newline="", encoding="utf-8") as out:
            rows(out)
    else:
        rows(dest)
