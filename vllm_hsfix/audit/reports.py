"""What the auditor concludes: findings, the three verdicts, per-file and per-run reports.

Verdicts:

* ``corrupt``: unusable as training data: unreadable, truncated or not safetensors,
  missing keys or wrong dtypes/shapes, empty tensors, ``token_ids`` count not matching,
  any all-zero row, any NaN/Inf.
* ``suspect``: readable but probably damaged: identical rows at different token ids in
  the same aux layer, rows with a norm under 1e-3 x their layer's median, a per-layer
  median row norm far off the rest of the dataset (robust z-score over files), or
  ``[n_aux, hidden]`` differing from the dataset majority, or unexpected extra tensors.
* ``ok``: none of the above.

These are plain dataclasses, picklable for the worker pool and JSON-ready for ``--json``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .prefix import PrefixData

CORRUPT = "corrupt"
SUSPECT = "suspect"
OK = "ok"


@dataclass
class Problem:
    """One finding. ``code`` is stable for scripts; ``detail`` is for people."""

    code: str
    severity: str
    detail: str


@dataclass
class LayerStats:
    """Row-norm statistics of one aux layer over its finite, non-zero rows.

    The dataset pass compares ``median_norm`` across files (a median, not the mean,
    because attention-sink tokens legitimately have norms 100x the others, and a short
    prompt's mean would then look like an outlier).
    """

    aux: int
    count: int
    mean_norm: float | None
    std_norm: float | None
    median_norm: float | None
    min_norm: float | None
    max_norm: float | None
    zero_rows: int = 0
    nonfinite_rows: int = 0
    near_zero_rows: int = 0
    duplicate_rows: int = 0


@dataclass
class FileReport:
    """Everything the auditor learned about one file; picklable for the worker pool."""

    path: str
    bytes: int = 0
    verdict: str = OK
    dtype: str | None = None
    n_tokens: int | None = None
    n_aux: int | None = None
    hidden: int | None = None
    n_token_ids: int | None = None
    token_mismatch: bool = False
    zero_rows: int = 0
    nan_count: int = 0
    inf_count: int = 0
    duplicate_rows: int = 0
    near_zero_rows: int = 0
    layers: list[LayerStats] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    provenance: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    # First token ids and row sketches for the cross-file prefix check (dropped after it).
    prefix: PrefixData | None = field(default=None, repr=False)

    def add(self, code: str, severity: str, detail: str) -> None:
        """Record a finding and keep the verdict the worst severity seen."""
        self.problems.append(Problem(code, severity, detail))
        if severity == CORRUPT or (severity == SUSPECT and self.verdict == OK):
            self.verdict = severity

    def codes(self) -> list[str]:
        """The problem codes, for tests and filters."""
        return [p.code for p in self.problems]

    def reason(self) -> str:
        """One line: every finding's detail."""
        return "; ".join(p.detail for p in self.problems)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (no NaN: missing statistics are ``None``)."""
        out = asdict(self)
        out.pop("prefix", None)
        return out


@dataclass
class AuditReport:
    """A whole run: per-file reports (input order), dataset references and totals."""

    files: list[FileReport]
    wall_s: float
    workers: int
    dataset: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def count(self, verdict: str) -> int:
        """Number of files with ``verdict``."""
        return sum(f.verdict == verdict for f in self.files)

    @property
    def regenerate(self) -> list[str]:
        """Files to produce again with a fixed vLLM: the corrupt and the suspect ones."""
        return [f.path for f in self.files if f.verdict != OK]

    def totals(self) -> dict[str, Any]:
        """Counts and throughput (GB = 1e9 bytes)."""
        wall = max(self.wall_s, 1e-9)
        return {
            "files": len(self.files),
            "bytes": self.total_bytes,
            OK: self.count(OK),
            SUSPECT: self.count(SUSPECT),
            CORRUPT: self.count(CORRUPT),
            "wall_s": round(self.wall_s, 4),
            "gb_per_s": round(self.total_bytes / 1e9 / wall, 4),
            "files_per_s": round(len(self.files) / wall, 2),
            "workers": self.workers,
        }

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` document."""
        return {
            "schema": 1,
            "totals": self.totals(),
            "regenerate": self.regenerate,
            "dataset": self.dataset,
            "files": [f.to_dict() for f in self.files],
        }
