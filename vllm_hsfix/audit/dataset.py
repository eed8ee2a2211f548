"""The dataset pass: cross-file checks no single file can answer (the ``[n_aux, hidden]``
majority, per-layer norm outliers), over the :class:`Ledger` (shared prefixes: :mod:`.prefix`)."""

from __future__ import annotations

import math
from array import array
from typing import TYPE_CHECKING, Any

from .reports import SUSPECT, UNSUPPORTED, VERDICTS, FileReport, Problem, worse

if TYPE_CHECKING:
    from numpy.typing import NDArray


Findings = dict[int, list[Problem]]
_NONE = 255  # no verdict recorded
_CODE = {v: k for k, v in enumerate(VERDICTS)}


class Ledger:
    """What the dataset pass reads of files ``0..n-1`` of one audit, as numpy columns
    (the reports themselves may be written out and dropped)."""

    def __init__(self, n: int) -> None:
        import numpy as np

        self.code = np.full(n, _NONE, dtype=np.uint8)  # index into VERDICTS
        self.n_tokens = np.full(n, -1, dtype=np.int64)  # -1: not known (header unread)
        self.n_aux = np.zeros(n, dtype=np.int32)  # 0: not known
        self.hidden = np.zeros(n, dtype=np.int32)
        self.first = np.zeros(n, dtype=np.int64)  # where its medians start in _medians
        self.layers = np.zeros(n, dtype=np.int32)  # how many medians it has
        self._medians = array("d")  # NaN: none (no sound row, or not finite)

    def put(self, i: int, rep: FileReport) -> None:
        """File ``i``'s judged report (anything but ``pending``)."""
        self.code[i] = _CODE[rep.verdict]
        self.n_tokens[i] = -1 if rep.n_tokens is None else rep.n_tokens
        self.n_aux[i] = rep.n_aux or 0
        self.hidden[i] = rep.hidden or 0
        self.first[i] = len(self._medians)
        self.layers[i] = len(rep.layers)
        nan = math.nan
        self._medians.extend([nan if s.median_norm is None else s.median_norm for s in rep.layers])

    def add(self, i: int, severity: str) -> None:
        """Keep file ``i``'s verdict in step with a dataset-level finding."""
        self.code[i] = _CODE[worse(VERDICTS[self.code[i]], severity)]

    def verdicts(self) -> list[str | None]:
        """Every file's verdict (None where none was recorded), in file order."""
        names = (*VERDICTS, *([None] * (_NONE + 1 - len(VERDICTS))))
        return [names[c] for c in self.code.tolist()]

    def judged(self) -> NDArray[Any]:
        """The files the cross-file checks take: those with a verdict, except files of a
        format the audit does not know (no rows were read; they stay ``unsupported``)."""
        import numpy as np

        return np.flatnonzero((self.code != _NONE) & (self.code != _CODE[UNSUPPORTED]))

    def medians(self, files: NDArray[Any], aux: int) -> NDArray[Any]:
        """Aux layer ``aux``'s median row norm of each of ``files`` (which have that
        layer), NaN where it has none."""
        import numpy as np

        values = np.frombuffer(self._medians, dtype=np.float64)
        return values[self.first[files] + aux]  # a copy: the array may grow again


def add_finding(findings: Findings, ledger: Ledger, i: int, problem: Problem) -> None:
    """Record a dataset-level finding for file ``i`` and update its verdict."""
    findings.setdefault(i, []).append(problem)
    ledger.add(i, problem.severity)


# A file whose per-layer median row norm is more than OUTLIER_MADS scaled MADs from the
# dataset's median of that layer is an outlier; REL_FLOOR keeps a very uniform dataset
# (MAD ~ 0) from flagging files a few percent off (real chat datasets: docs/audit.md).
OUTLIER_MADS = 6.0
MAD_SCALE = 1.4826
REL_FLOOR = 0.05
MIN_FILES_FOR_OUTLIERS = 3


def dataset_pass(ledger: Ledger, judged: NDArray[Any], findings: Findings) -> dict[str, Any]:
    """Cross-file checks, which no single file can answer, over the files ``judged``
    (indices, ascending): the ``[n_aux, hidden]`` majority, and per aux layer, files whose
    median row norm is a robust outlier. Findings go into ``findings`` (by file index)."""
    import numpy as np

    info: dict[str, Any] = {"majority_shape": None, "norm_reference": []}
    shaped = judged[(ledger.n_aux[judged] > 0) & (ledger.hidden[judged] > 0)]
    n_shaped = len(shaped)
    if not n_shaped:
        return info
    pairs = np.stack([ledger.n_aux[shaped], ledger.hidden[shaped]], axis=1).astype(np.int64)
    shapes, which, counts = np.unique(pairs, axis=0, return_inverse=True, return_counts=True)
    which = which.reshape(-1)
    if n_shaped >= MIN_FILES_FOR_OUTLIERS:
        top = int(counts.argmax())
        n = int(counts[top])
        if n * 2 > n_shaped:  # a strict majority (unique, so ties cannot matter)
            shape = [int(x) for x in shapes[top]]
            info["majority_shape"] = shape
            for k in np.flatnonzero(which != top).tolist():
                i = int(shaped[k])
                detail = (
                    f"[n_aux, hidden] = [{int(pairs[k, 0])}, {int(pairs[k, 1])}] but {n} of "
                    f"{n_shaped} files have {shape}"
                )
                add_finding(findings, ledger, i, Problem("shape_outlier", SUSPECT, detail))
    for s, (n_aux, hidden) in enumerate(shapes.tolist()):  # ascending, as sorted() gives
        group = shaped[which == s]
        for a in range(n_aux):
            _norm_outliers(ledger, group, n_aux, hidden, a, info, findings)
    return info


def _norm_outliers(
    ledger: Ledger,
    group: NDArray[Any],
    n_aux: int,
    hidden: int,
    a: int,
    info: dict[str, Any],
    findings: Findings,
) -> None:
    """Aux layer ``a`` of the files ``group`` (one shape): files whose median row norm is
    a robust outlier among theirs."""
    import numpy as np

    have = group[ledger.layers[group] > a]
    vals = ledger.medians(have, a)
    keep = ~np.isnan(vals)
    members, vals = have[keep], vals[keep]
    if len(members) < MIN_FILES_FOR_OUTLIERS:
        return
    med = float(np.median(vals))
    mad = float(np.median(np.abs(vals - med)))
    scale = max(MAD_SCALE * mad, REL_FLOOR * abs(med))
    info["norm_reference"].append(
        {
            "n_aux": n_aux,
            "hidden": hidden,
            "aux": a,
            "files": len(members),
            "median": med,
            "mad": mad,
            "threshold": OUTLIER_MADS * scale,
        }
    )
    if scale <= 0:
        return
    z = np.abs(vals - med) / scale
    for k in np.flatnonzero(z > OUTLIER_MADS).tolist():
        v = float(vals[k])
        ratio = v / med if med else math.inf
        detail = (
            f"aux slot {a}: median row norm {v:.4g} is {ratio:.3g}x the dataset "
            f"median {med:.4g} (robust z {float(z[k]):.1f} > {OUTLIER_MADS:g})"
        )
        add_finding(findings, ledger, int(members[k]), Problem("norm_outlier", SUSPECT, detail))
