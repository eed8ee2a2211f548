"""``audit --state FILE``: audit a dataset while it is still being written, rescanning
only what changed.

The state keeps each file's per-file results (its report before the dataset-level
checks, and its prefix sketch) keyed by path, size and modification time. A rerun
takes a file from the state when all three still match and scans it otherwise; the
dataset-level checks always run again over every file (a new file can change the
consensus of an old one's prefix group). Files still locked by their writer, and files
whose scan failed for a reason that may pass (unreadable: I/O error, dead worker), are
never stored, so the next run looks at them again.

Format: JSON lines, never pickle (a state file on a shared filesystem must not be able
to run code): a header line, then one line per file; arrays as base64. Lines are
appended (and flushed) as files are judged, so an audit killed halfway keeps what it
did; the file is rewritten compactly, through a temporary file and a rename, at the
end. A state written by another vllm-hsfix version or checks revision is ignored (and
said so): the checks may have changed.
"""

from __future__ import annotations

import base64
import json
import os
from typing import IO, Any

from .._version import __version__
from .prefix import PrefixData
from .reports import PENDING, VERDICTS, FileReport

# Bump when a per-file check changes what it reports: old states are then rescanned.
# 2: fp8 files de-quantized (were corrupt), unknown formats ``unsupported``.
CHECKS_REVISION = 2
_HEADER = {"kind": "vllm-hsfix audit state", "version": __version__, "checks": CHECKS_REVISION}
# Findings that say nothing lasting about the file.
TRANSIENT = frozenset({"unreadable"})


def _arr(a: Any) -> dict[str, Any]:
    return {"dtype": str(a.dtype), "shape": list(a.shape), "b64": base64.b64encode(a).decode()}


def _unarr(d: dict[str, Any]) -> Any:
    import numpy as np

    raw = base64.b64decode(d["b64"])
    return np.frombuffer(raw, dtype=d["dtype"]).reshape(d["shape"]).copy()


def _prefix_out(p: PrefixData | None) -> dict[str, Any] | None:
    if p is None:
        return None
    return {
        "token_ids": list(p.token_ids),
        "sketches": _arr(p.sketches),
        "norms": _arr(p.norms),
        "sound": _arr(p.sound),
        "shape_key": list(p.shape_key),
    }


def _prefix_in(d: dict[str, Any] | None) -> PrefixData | None:
    if d is None:
        return None
    return PrefixData(
        token_ids=tuple(d["token_ids"]),
        sketches=_unarr(d["sketches"]),
        norms=_unarr(d["norms"]),
        sound=_unarr(d["sound"]),
        shape_key=(int(d["shape_key"][0]), int(d["shape_key"][1])),
    )


class State:
    """The per-file results of earlier runs, and the lines of this one."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.note = ""  # why an existing state was not used, for the run's output
        self._old: dict[str, str] = {}  # path -> its raw line (decoded on use)
        self._new: dict[str, str] = {}
        self._out: IO[str] | None = None
        self._load()

    def _load(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return
        try:
            header = json.loads(lines[0]) if lines else {}
        except ValueError:
            header = {}
        if header != _HEADER:
            self.note = (
                f"--state {self.path}: written by another vllm-hsfix version or checks "
                "revision (or not a state file): every file is scanned again"
            )
            return
        for line in lines[1:]:
            try:
                path = json.loads(line)["path"]
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a killed run
            self._old[path] = line

    def lookup(self, path: str, size: int, mtime_ns: int) -> FileReport | None:
        """The stored per-file report (with its prefix sketch), if the file is unchanged."""
        line = self._old.get(path)
        if line is None:
            return None
        try:
            d = json.loads(line)
            if d.get("size") != size or d.get("mtime_ns") != mtime_ns:
                return None
            rep = FileReport.from_dict(d["report"])
            rep.prefix = _prefix_in(d.get("prefix"))
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return None  # a line this version cannot read back: the file is scanned again
        if rep.verdict not in VERDICTS or rep.verdict == PENDING:
            return None
        self._new[path] = line  # already on disk: kept at save(), not appended again
        return rep

    def put(self, rep: FileReport, size: int, mtime_ns: int) -> None:
        """Store a freshly scanned file's per-file results (before any dataset check)."""
        if TRANSIENT & set(rep.codes()):
            return
        d = {
            "path": rep.path,
            "size": size,
            "mtime_ns": mtime_ns,
            "report": rep.to_dict(),
            "prefix": _prefix_out(rep.prefix),
        }
        self._keep(rep.path, json.dumps(d, separators=(",", ":")))

    def _keep(self, path: str, line: str) -> None:
        self._new[path] = line
        if self._out is None:
            # Appending to the old file keeps what an interrupted run did; a run on a
            # rejected state starts the file over.
            mode = "a" if self._old else "w"
            self._out = open(self.path, mode, encoding="utf-8")  # noqa: SIM115
            if mode == "w":
                self._out.write(json.dumps(_HEADER) + "\n")
        self._out.write(line + "\n")
        self._out.flush()

    def save(self) -> None:
        """Rewrite the state with this run's files only (deleted files drop out)."""
        if self._out is not None:
            self._out.close()
            self._out = None
        tmp = f"{self.path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(_HEADER) + "\n")
            for line in self._new.values():
                f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
