"""What the dataset pass reads of each judged file, as numpy columns (the reports
themselves may already be written out and dropped)."""

from __future__ import annotations

import math
from array import array
from typing import TYPE_CHECKING, Any

from .reports import UNSUPPORTED, VERDICTS, FileReport, worse

if TYPE_CHECKING:
    from numpy.typing import NDArray

_NONE = 255  # no verdict recorded
_CODE = {v: k for k, v in enumerate(VERDICTS)}


class Ledger:
    """Columns for the files ``0..n-1`` of one audit (their indices in its file list)."""

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
