"""The dataset pass: cross-file checks, which no single file can answer.

Run after every file has been scanned: the ``[n_aux, hidden]`` majority, per aux layer
the files whose median row norm is a robust outlier, and the shared-prefix consistency
check (:mod:`.prefix`). They read only each file's :class:`.reports.Sketch` and the
prefix sketches kept in columns (:class:`.prefix.Store`; the reports themselves may
already be written out and gone) and return their findings by
file index, plus what they compared against, for the report's ``dataset`` section.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from . import prefix
from .reports import CORRUPT, SUSPECT, Problem, Sketch

Findings = dict[int, list[Problem]]


def add_finding(findings: Findings, files: list[Sketch], i: int, problem: Problem) -> None:
    """Record a dataset-level finding for file ``i`` and update its sketch's verdict."""
    findings.setdefault(i, []).append(problem)
    files[i].add(problem)


# Dataset pass: flag a file whose per-layer median row norm is more than OUTLIER_MADS
# scaled MADs (1.4826 x MAD estimates one standard deviation for normal data) away from
# the dataset median of that layer. REL_FLOOR keeps a very uniform dataset (MAD ~ 0) from
# flagging files that differ by a few percent: with it, a file is an outlier only when
# its median norm is more than 6 x 5% = 30% off. Measured on real vLLM output (chat-like
# prompts sharing templates: norms very uniform), a floor of 1% flagged a correct
# 14-token file whose median norm was 0.935x the dataset's.
OUTLIER_MADS = 6.0
MAD_SCALE = 1.4826
REL_FLOOR = 0.05
MIN_FILES_FOR_OUTLIERS = 3


def dataset_pass(files: list[Sketch], findings: Findings) -> dict[str, Any]:
    """Cross-file checks, which no single file can answer: the ``[n_aux, hidden]``
    majority, and per aux layer, files whose median row norm is a robust outlier.
    Findings go into ``findings`` (by index into ``files``)."""
    import numpy as np

    info: dict[str, Any] = {"majority_shape": None, "norm_reference": []}
    shapes = Counter((f.n_aux, f.hidden) for f in files if f.n_aux and f.hidden)
    n_shaped = sum(shapes.values())
    if shapes and n_shaped >= MIN_FILES_FOR_OUTLIERS:
        (shape, n), *_ = shapes.most_common(1)
        if n * 2 > n_shaped:
            info["majority_shape"] = list(shape)
            for i, f in enumerate(files):
                if f.n_aux and f.hidden and (f.n_aux, f.hidden) != shape:
                    detail = (
                        f"[n_aux, hidden] = [{f.n_aux}, {f.hidden}] but {n} of {n_shaped} "
                        f"files have {list(shape)}"
                    )
                    add_finding(findings, files, i, Problem("shape_outlier", SUSPECT, detail))
    for n_aux, hidden in sorted(shapes):
        group = [i for i, f in enumerate(files) if (f.n_aux, f.hidden) == (n_aux, hidden)]
        for a in range(n_aux):
            members = [
                (i, files[i].medians[a])
                for i in group
                if len(files[i].medians) > a and files[i].medians[a] is not None
            ]
            if len(members) < MIN_FILES_FOR_OUTLIERS:
                continue
            vals = np.array([v for _, v in members], dtype=np.float64)
            med = float(np.median(vals))
            mad = float(np.median(np.abs(vals - med)))
            scale = max(MAD_SCALE * mad, REL_FLOOR * abs(med))
            ref = {
                "n_aux": n_aux,
                "hidden": hidden,
                "aux": a,
                "files": len(members),
                "median": med,
                "mad": mad,
                "threshold": OUTLIER_MADS * scale,
            }
            info["norm_reference"].append(ref)
            if scale <= 0:
                continue
            for i, v in members:
                z = abs(v - med) / scale  # type: ignore[operator]
                if z > OUTLIER_MADS:
                    ratio = v / med if med else math.inf  # type: ignore[operator]
                    detail = (
                        f"aux layer {a}: median row norm {v:.4g} is {ratio:.3g}x the dataset "
                        f"median {med:.4g} (robust z {z:.1f} > {OUTLIER_MADS:g})"
                    )
                    add_finding(findings, files, i, Problem("norm_outlier", SUSPECT, detail))
    return info


def prefix_pass(
    files: list[Sketch],
    findings: Findings,
    store: prefix.Store,
    positions: Any,
    tick: prefix.Tick | None = None,
) -> dict[str, Any]:
    """Cross-file shared-prefix consistency (:mod:`.prefix`) over the files' sketches in
    ``store`` (``positions``: a stored file's index in ``files``, -1 for none); findings
    are corrupt. ``tick(n)`` reports progress in files."""
    result = prefix.check(store, positions, len(files), tick)
    for index, finding in sorted(result.findings.items()):
        problem = Problem("prefix_mismatch", CORRUPT, prefix.describe(finding))
        add_finding(findings, files, index, problem)
    return result.summary(len(files))
