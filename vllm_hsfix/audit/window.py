"""One window of stored rows -> the per-row numbers the checks need (squared norm,
key, zero and NaN/Inf flags), by the compiled kernel or numpy blocks."""

from __future__ import annotations

import os
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from .decode import Rows, fp8_e4m3fn_table
from .format import HIDDEN_INT

if TYPE_CHECKING:
    from numpy.typing import NDArray

# Audits of fewer bytes use numpy: the kernel's load is repaid only past this size.
# ``KERNEL_ENV=0``: never.
MIN_BYTES = 1024 * 1024 * 1024
KERNEL_ENV = "VLLM_HSFIX_AUDIT_KERNEL"
_kernel: Any = None  # the loaded :mod:`.kernel` once :func:`enable` succeeded; False: failed


def enable(total_bytes: int) -> bool:
    """Use the compiled kernel in this process's scans when an audit of ``total_bytes``
    repays its load and it loads here (numba installed, not switched off); whether on."""
    global _kernel
    if _kernel is None and total_bytes >= MIN_BYTES and os.environ.get(KERNEL_ENV) != "0":
        try:
            from . import kernel

            kernel.warm(fp8_e4m3fn_table())
            _kernel = kernel
        except Exception:  # no numba, or it fails here: the numpy path, never an error
            _kernel = False
    return bool(_kernel)


# float32 working block: conversion and the row sums stay in the CPU caches.
BLOCK_BYTES = 1024 * 1024
# Rows up to this width get their squared norm from BLAS's dot (one thread up to 10,000
# values in OpenBLAS); wider rows from einsum.
DOT_MAX_WIDTH = 8192
# Row samples in the cheap per-row key (equal keys are confirmed on the whole row).
KEY_SAMPLES = 16


@lru_cache(maxsize=16)
def key_columns(hidden: int) -> tuple[NDArray[Any], NDArray[Any]]:
    """The sampled columns and odd multipliers of the row key (same for every file of
    one width: computed once per process, not once per file)."""
    import numpy as np

    cols = np.unique(np.linspace(0, hidden - 1, min(hidden, KEY_SAMPLES)).round().astype(np.intp))
    mult = np.random.default_rng(0x5EED).integers(1, 2**63, size=len(cols), dtype=np.uint64)
    mult |= np.uint64(1)
    return cols, mult


def row_keys(ints: NDArray[Any], cols: NDArray[Any], mult: NDArray[Any]) -> NDArray[Any]:
    """Cheap 64-bit key per row from a few sampled elements (wrapping multiply-add)."""
    import numpy as np

    sample = ints[:, cols].astype(np.uint64)
    sample *= mult
    return sample.sum(axis=1, dtype=np.uint64)


class RowNumbers:
    """One file's per-row numbers, filled window by window, and a float32 copy of its
    first ``head_rows`` rows (the prefix check's input)."""

    def __init__(self, n_rows: int, head_rows: int = 0, hidden: int = 0) -> None:
        import numpy as np

        self.head = np.zeros((min(head_rows, n_rows), hidden), dtype=np.float32)
        self.sumsq = np.zeros(n_rows, dtype=np.float64)
        self.keys = np.zeros(n_rows, dtype=np.uint64)
        self.zero = np.zeros(n_rows, dtype=bool)
        self.bad = np.zeros(n_rows, dtype=bool)
        self.nan = 0
        self.inf = 0


def _block_rows(nums: RowNumbers, row0: int, work: NDArray[Any]) -> None:
    """Squared norms, zero and non-finite rows of one block of float rows: one dot per
    row; a zero or non-finite sum looks again (underflow is not zero, overflow not Inf)."""
    import numpy as np

    n = work.shape[0]
    vecdot = getattr(np, "vecdot", None)  # numpy >= 2.0
    if vecdot is not None and work.shape[1] <= DOT_MAX_WIDTH:
        s = vecdot(work, work)  # one BLAS dot per row: 3x einsum's speed
    else:
        s = np.einsum("ij,ij->i", work, work)
    out = nums.sumsq[row0 : row0 + n]
    out[:] = s
    fin = np.isfinite(s)
    if not fin.all():
        idx = np.flatnonzero(~fin)
        sub = work[idx]
        nan = np.isnan(sub)
        inf = np.isinf(sub)
        nums.nan += int(nan.sum())
        nums.inf += int(inf.sum())
        rowbad = (nan | inf).any(axis=1)
        nums.bad[row0 + idx[rowbad]] = True
        out[idx[rowbad]] = np.nan
        big = ~rowbad  # finite values whose squares overflowed the working precision
        if big.any():
            out[idx[big]] = np.square(sub[big].astype(np.float64)).sum(axis=1)
    zc = s == 0
    if zc.any():
        idx = np.flatnonzero(zc)
        sub = work[idx]
        allzero = ~(sub != 0).any(axis=1)
        nums.zero[row0 + idx[allzero]] = True
        tiny = ~allzero  # non-zero values whose squares underflowed
        if tiny.any():
            out[idx[tiny]] = np.square(sub[tiny].astype(np.float64)).sum(axis=1)


def fill(
    nums: RowNumbers,
    raw: NDArray[Any],
    rows: Rows,
    row0: int,
    cols: NDArray[Any],
    mult: NDArray[Any],
) -> None:
    """Fill ``nums`` for stored rows ``raw`` ([n, hidden], rows ``row0``... of the
    file): from the kernel where it is on and every row is plain, else block by block,
    values then the per-row numbers of :func:`_block_rows`."""
    import numpy as np

    if _kernel and _kernel_rows(nums, raw, rows, row0, cols, mult):
        return
    n_rows, hidden = raw.shape
    block = max(1, BLOCK_BYTES // (hidden * rows.work_itemsize))
    buf = rows.buffer(min(block, n_rows))
    stored = None if rows.fp8 else raw.view(HIDDEN_INT[rows.dtype])
    if stored is not None:  # keys of stored values: the whole window in one go
        nums.keys[row0 : row0 + n_rows] = row_keys(stored, cols, mult)
    # Overflow is expected and handled (squares past float32 are summed again in
    # float64; F64 values past float32 make an unsound head row): no warnings.
    with np.errstate(all="ignore"):
        for b in range(0, n_rows, block):
            e = min(n_rows, b + block)
            work, ints = rows.block(raw[b:e], row0 + b, buf)
            _keep_head(nums, row0 + b, work)
            if stored is None:  # fp8: keys of the de-quantized values
                nums.keys[row0 + b : row0 + e] = row_keys(ints, cols, mult)
            _block_rows(nums, row0 + b, work)


def _kernel_rows(
    nums: RowNumbers,
    raw: NDArray[Any],
    rows: Rows,
    row0: int,
    cols: NDArray[Any],
    mult: NDArray[Any],
) -> bool:
    """The window's squared norms, keys and head rows from the compiled kernel; False
    when it does not take this dtype or a row needs :func:`_block_rows`'s closer look."""
    n = raw.shape[0]
    sumsq, keys = nums.sumsq[row0 : row0 + n], nums.keys[row0 : row0 + n]
    if rows.dtype == "BF16":
        odd = _kernel.bf16(raw.view(HIDDEN_INT["BF16"]), cols, mult, sumsq, keys)
    elif rows.dtype == "F32":
        odd = _kernel.f32(raw, cols, mult, sumsq, keys)
    elif rows.fp8:
        scales = rows.row_scales[row0 : row0 + n]  # type: ignore[index]
        odd = _kernel.fp8(rows.table, raw, scales, cols, mult, sumsq, keys)
    else:
        return False
    if odd:
        return False
    if row0 < len(nums.head):
        take = min(len(nums.head) - row0, n)
        head = nums.head[row0 : row0 + take]
        if rows.fp8:
            _kernel.fp8_values(rows.table, raw[:take], rows.row_scales[row0 : row0 + take], head)
        else:
            rows.into(raw[:take], head)
    return True


def _keep_head(nums: RowNumbers, row0: int, work: NDArray[Any]) -> None:
    """Keep the rows of ``work`` (values of rows ``row0``...) that fall in the head."""
    take = min(len(nums.head) - row0, len(work))
    if take > 0:
        nums.head[row0 : row0 + take] = work[:take]
