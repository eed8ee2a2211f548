"""What the auditor concludes: findings, verdicts (``ok``, ``suspect``, ``corrupt``,
``unsupported``, ``pending``; docs/audit.md), per-file and per-run reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .prefix import PrefixData

CORRUPT = "corrupt"
SUSPECT = "suspect"
OK = "ok"
PENDING = "pending"
UNSUPPORTED = "unsupported"
VERDICTS = (OK, SUSPECT, CORRUPT, PENDING, UNSUPPORTED)
# Which verdict wins when a file gets findings of several severities.
_RANK = {OK: 0, PENDING: 1, SUSPECT: 2, UNSUPPORTED: 3, CORRUPT: 4}
# The ``--json`` report's schema (what each version changed: CHANGELOG.md).
SCHEMA = 3


def worse(verdict: str, severity: str) -> str:
    """The verdict after a finding of ``severity``: the worst of the two."""
    return severity if _RANK.get(severity, 0) > _RANK.get(verdict, 0) else verdict


@dataclass
class Problem:
    """One finding: ``code`` for scripts, ``detail`` for people, ``hazard`` the row of
    ``vllm_hsfix.hazards`` whose signature it is, if any."""

    code: str
    severity: str
    detail: str
    hazard: str = ""


@dataclass
class LayerStats:
    """Row-norm statistics of one aux layer over its finite, non-zero rows (the dataset
    pass compares medians: attention-sink tokens have norms 100x the others)."""

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


_NOT_IN_DICT = frozenset({"prefix", "layers", "problems", "provenance"})


@dataclass
class FileReport:
    """Everything the auditor learned about one file; picklable for the worker pool."""

    path: str
    bytes: int = 0
    verdict: str = OK
    dtype: str | None = None
    # The file layout it was read as (``format.PLAIN``, ``format.FP8``); None when the
    # audit does not know it (``unsupported``) or could not read the header.
    format: str | None = None
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
        self.verdict = worse(self.verdict, severity)

    def codes(self) -> list[str]:
        """The problem codes, for tests and filters."""
        return [p.code for p in self.problems]

    def reason(self) -> str:
        """One line: every finding's detail."""
        return "; ".join(p.detail for p in self.problems)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (no NaN: missing statistics are ``None``). Built field by field:
        ``dataclasses.asdict`` deep-copies every value, and this runs once per file
        in the driver, where it set the pace of small-file audits."""
        out = {k: v for k, v in vars(self).items() if k not in _NOT_IN_DICT}
        out["layers"] = [dict(vars(st)) for st in self.layers]
        out["problems"] = [dict(vars(p)) for p in self.problems]
        out["provenance"] = dict(self.provenance)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FileReport:
        """The inverse of :meth:`to_dict` (``--state`` reads reports back)."""
        d = dict(d)
        layers = [LayerStats(**x) for x in d.pop("layers", [])]
        problems = [Problem(**x) for x in d.pop("problems", [])]
        return cls(**d, layers=layers, problems=problems)


@dataclass
class AuditReport:
    """A whole run: every file's final verdict (input order), the full per-file reports
    when they were kept (``keep=True``: ``--json``, ``--csv``, library calls; a
    streaming run writes them out instead), dataset references and totals."""

    files: list[FileReport]
    verdicts: list[tuple[str, str]]  # (path, verdict)
    total_bytes: int
    wall_s: float
    workers: int
    dataset: dict[str, Any]
    backend: str = "local"  # or "ray": where the per-file scan ran
    reused: int = 0  # files whose per-file results came from ``--state``, not a scan

    def count(self, verdict: str) -> int:
        """Number of files with ``verdict``."""
        return sum(v == verdict for _, v in self.verdicts)

    def paths(self, verdict: str) -> list[str]:
        """The files with ``verdict``, in input order."""
        return [p for p, v in self.verdicts if v == verdict]

    @property
    def regenerate(self) -> list[str]:
        """Files to produce again with a fixed vLLM: the corrupt ones only (suspect
        files come from heuristics: look at them, do not delete them unseen)."""
        return self.paths(CORRUPT)

    @property
    def suspect(self) -> list[str]:
        return self.paths(SUSPECT)

    def totals(self) -> dict[str, Any]:
        """Counts and throughput (GB = 1e9 bytes)."""
        wall = max(self.wall_s, 1e-9)
        return {
            "files": len(self.verdicts),
            "bytes": self.total_bytes,
            OK: self.count(OK),
            SUSPECT: self.count(SUSPECT),
            CORRUPT: self.count(CORRUPT),
            PENDING: self.count(PENDING),
            UNSUPPORTED: self.count(UNSUPPORTED),
            "wall_s": round(self.wall_s, 4),
            "gb_per_s": round(self.total_bytes / 1e9 / wall, 4),
            "files_per_s": round(len(self.verdicts) / wall, 2),
            "workers": self.workers,
            "backend": self.backend,
            "reused": self.reused,
        }

    def to_dict(self, files: bool = True) -> dict[str, Any]:
        """The ``--json`` document (needs the kept reports); without ``files``, the summary."""
        out = {
            "schema": SCHEMA,
            "totals": self.totals(),
            "regenerate": self.regenerate,
            SUSPECT: self.suspect,
            PENDING: self.paths(PENDING),
            UNSUPPORTED: self.paths(UNSUPPORTED),
            "dataset": self.dataset,
        }
        if files:
            out["files"] = [f.to_dict() for f in self.files]
        return out


# Known hazards' signatures: the finding a hazard of ``vllm_hsfix.hazards`` leaves in
# its files, by code, names it (``Problem.hazard``; the ids as the register spells them).
SIGNATURES = {
    "token_mismatch": (
        "prefix-cache-slicing",
        "vLLM 0.22-0.23 with prefix caching on saves fewer rows than token ids",
    ),
    "truncated": (
        "torn-files",
        "a writer killed mid-write (safetensors < 0.8.0 writes the final path in place; "
        "vllm-hsfix's atomic-writes prevents it)",
    ),
    "aux_layers_identical": (
        "aux-final-layer-dropped",
        "an aux layer id equal to num_hidden_layers on DeepSeek-V2-backbone models, vLLM "
        "0.18-0.24, saves one state into both slots",
    ),
}
HAZARD_IDS = tuple(hazard for hazard, _ in SIGNATURES.values())


def attribute(rep: FileReport) -> None:
    """Name the hazard behind each finding of ``rep`` that carries a known signature
    (too few rows for the token ids, not too many, is prefix-cache-slicing's)."""
    too_few = (
        rep.n_tokens is not None and rep.n_token_ids is not None and rep.n_tokens < rep.n_token_ids
    )
    for p in rep.problems:
        if p.code not in SIGNATURES or p.hazard or (p.code == "token_mismatch" and not too_few):
            continue
        p.hazard, note = SIGNATURES[p.code]
        p.detail += f" (the signature of hazard {p.hazard}: {note})"


# The records of ``--jsonl`` (docs/audit.md): a file record per file as it is judged, an
# update per file a dataset check changed, then the summary.
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
    return {"type": SUMMARY, **report.to_dict(files=False)}
