"""The dataset pass over the driver's per-file columns (``vllm_hsfix.audit.ledger``).

Expectations come from how each file's numbers were made (which files were scaled,
given another shape, left without a median), not from the code under test; the
memory bound is the one the columns were introduced for."""

from __future__ import annotations

import numpy as np

from vllm_hsfix.audit.dataset import Ledger, dataset_pass
from vllm_hsfix.audit.reports import (
    CORRUPT,
    OK,
    PENDING,
    SUSPECT,
    UNSUPPORTED,
    FileReport,
    LayerStats,
)


def report(i: int, medians: list[float | None], shape: tuple[int, int] = (4, 64)) -> FileReport:
    layers = [LayerStats(a, 10, m, 0.1, m, m, m) for a, m in enumerate(medians)]
    return FileReport(
        path=f"hs_{i}.safetensors", n_tokens=10 + i, n_aux=shape[0], hidden=shape[1], layers=layers
    )


def test_outliers_and_shapes_by_file_index() -> None:
    """60 files of [4, 64] whose layer medians spread 2% around 1, 2, 3, 4; file 7's
    layer 2 ten times larger, file 11's layer 0 a third, file 13 of another shape, file
    17 with no median on layer 1 (no sound row), a pending and an unsupported file, and
    a file with one layer fewer: exactly 7 (layer 2) and 11 (layer 0) are norm
    outliers, 13 a shape outlier, and the per-layer references count the files that
    had that layer's median."""
    rng = np.random.default_rng(1)
    n = 64
    ledger = Ledger(n)
    base = np.array([1.0, 2.0, 3.0, 4.0])
    for i in range(n):
        m: list[float | None] = list(base * (1 + 0.02 * rng.uniform(-1, 1, 4)))
        shape = (4, 64)
        if i == 7:
            m[2] = 30.0
        if i == 11:
            m[0] = 1.0 / 3
        if i == 13:
            shape = (3, 64)
            m = m[:3]
        if i == 17:
            m[1] = None
        if i == 19:
            m = m[:3]  # a layer short (its report had three)
        rep = report(i, m, shape)
        if i == 21:
            rep.verdict = PENDING
            continue  # the pipeline keeps pending files out of the ledger
        if i == 23:
            rep.verdict = UNSUPPORTED
        if i == 29:
            rep.verdict = CORRUPT  # judged: still compared (its finding stays corrupt)
        ledger.put(i, rep)
    judged = ledger.judged()
    assert 21 not in judged and 23 not in judged and len(judged) == n - 2
    findings: dict = {}
    info = dataset_pass(ledger, judged, findings)
    assert {i: [p.code for p in ps] for i, ps in findings.items()} == {
        7: ["norm_outlier"],
        11: ["norm_outlier"],
        13: ["shape_outlier"],
    }
    assert "aux layer 2: median row norm 30 is" in findings[7][0].detail
    assert info["majority_shape"] == [4, 64]
    refs = {(r["n_aux"], r["aux"]): r["files"] for r in info["norm_reference"]}
    # [4, 64]: 62 judged, one of them of [3, 64]; 61 left; layer 1 lacks file 17,
    # layer 3 lacks file 19 (three layers). [3, 64]: one file, too few to compare.
    assert refs == {(4, 0): 61, (4, 1): 60, (4, 2): 61, (4, 3): 60}
    verdicts = ledger.verdicts()
    assert verdicts[7] == SUSPECT and verdicts[13] == SUSPECT and verdicts[29] == CORRUPT
    assert verdicts[0] == OK and verdicts[21] is None and verdicts[23] == UNSUPPORTED


def test_no_majority_no_shape_outliers() -> None:
    """Two shapes in equal numbers: no majority, so nobody is a shape outlier."""
    ledger = Ledger(6)
    for i in range(6):
        ledger.put(i, report(i, [1.0, 2.0], (2, 64 if i % 2 else 128)))
    findings: dict = {}
    info = dataset_pass(ledger, ledger.judged(), findings)
    assert info["majority_shape"] is None and findings == {}
