"""Every row's squared norm in one compiled pass, where numba is installed.

The scan's numpy path (:mod:`.decode`, then the blocks of :mod:`.window`) widens each
block to float32 and then reduces it: three passes over every value, which held the
audit to about a third of ``cat``'s speed. vLLM requires numba (every vLLM image has
it), so there the rows' squared norms come from one loop per row that reads the stored
bits (BF16, F32, hs-connectors' fp8 times its token's scale) and accumulates in
float32, as numpy's dot does. Only the squared norms come from here: a window with a
zero or non-finite sum, the first rows the prefix check keeps, and the row keys still
go through the numpy path, so every finding is decided as before.

Compiled once per machine and loaded once per process (numba's disk cache,
``cache=True``, where it can write); the pool loads it in the driver before it forks
its workers, and only for audits large enough to repay that (:data:`MIN_BYTES`).
``VLLM_HSFIX_AUDIT_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import os
from functools import lru_cache, partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from numpy.typing import NDArray

# Audits of fewer bytes than this use the numpy path. Loading the kernel costs about
# 0.5 s (importing numba; a first compile about 3 s more, once per machine), which it
# repays after about 3 GB of bf16 rows or 0.25 GB of fp8 rows (measured on a 2-core
# EPYC: bf16 2.4 -> 4 GB/s, fp8 0.4 -> 1.9 GB/s per process; the fp8 kernel is faster since:
# 2.4 -> 9.5 GB/s alone on a 2-core Xeon with tables, 3.9 -> 10.6 on the EPYC with bits).
MIN_BYTES = 1024 * 1024 * 1024
ENV = "VLLM_HSFIX_AUDIT_KERNEL"
# Whether this process's scans use the kernel (:func:`enable`; the pool sets it in the
# driver before it forks, and in each worker it starts otherwise).
ON = False


@lru_cache(maxsize=1)
def _compiled() -> Any:
    """The numba functions (compiled, or loaded from numba's cache), or None where
    numba is missing, switched off, or fails here."""
    if os.environ.get(ENV, "1") == "0":
        return None
    try:
        import numpy as np

        from . import _numba_rows as k

        # Compile now (or load the disk cache): a failure means no kernel, never an error.
        c, m, s, kk = (
            np.zeros(1, np.intp),
            np.ones(1, np.uint64),
            np.zeros(1),
            np.zeros(1, np.uint64),
        )
        k.bf16(np.zeros((1, 2), np.uint16), c, m, s, kk)
        k.f32(np.zeros((1, 2), np.float32), c, m, s, kk)
        values = _fp8_values()
        k.fp8(values, np.zeros((1, 3), np.uint8), np.ones(1, np.float32), c, m, s, kk)
        k.bf16_values(np.zeros((1, 2), np.uint16), None, np.zeros((1, 2), np.float32))
        k.fp8_values(
            np.zeros((1, 2), np.uint8), np.ones(1, np.float32), np.zeros((1, 2), np.float32)
        )
    except Exception:
        return None
    return {
        "BF16": k.bf16,
        "F32": k.f32,
        "F8_E4M3": partial(k.fp8, values),
        "values BF16": k.bf16_values,
        "values F8_E4M3": k.fp8_values,
    }


def _fp8_values() -> NDArray[Any]:
    """Every fp8 byte's value x 2**-120 (float32 [256]): the fp8 kernel's row keys."""
    import numpy as np

    from .decode import fp8_e4m3fn_table

    return (fp8_e4m3fn_table() * np.float32(2.0**-120)).astype(np.float32)


def available() -> bool:
    """Whether the kernel loads here (loading it now, once per process)."""
    return _compiled() is not None


def enable(total_bytes: int) -> bool:
    """Use the kernel in this process's scans when an audit of ``total_bytes`` repays
    its compile (:data:`MIN_BYTES`) and it compiles here; whether it is on."""
    global ON
    if total_bytes >= MIN_BYTES and _compiled() is not None:
        ON = True
    return ON


def rows(
    raw: NDArray[Any],
    dtype: str,
    factor: NDArray[Any] | None,
    cols: NDArray[Any],
    mult: NDArray[Any],
    sumsq: NDArray[Any],
    keys: NDArray[Any],
) -> bool | None:
    """Fill ``sumsq`` (float64 [n]) and ``keys`` (uint64 [n]) for the stored rows
    ``raw`` [n, hidden] of ``dtype`` (BF16 as its uint16 bits; fp8 with ``factor`` [n],
    its rows' scale x 2**120), the keys sampling columns ``cols`` with multipliers
    ``mult``. Returns None where the kernel cannot do it here (nothing filled), else
    whether a row needs the numpy path's closer look (a zero or non-finite sum)."""
    fns = _compiled()
    if fns is None or dtype not in fns:
        return None
    if dtype == "F8_E4M3":
        if factor is None:
            return None
        return bool(fns[dtype](raw, factor, cols, mult, sumsq, keys))  # values bound
    return bool(fns[dtype](raw, cols, mult, sumsq, keys))


def values(raw: NDArray[Any], dtype: str, factor: NDArray[Any] | None, out: NDArray[Any]) -> bool:
    """The float32 values of the stored rows ``raw`` (as for :func:`rows`) into ``out``
    [n, hidden]: the rows the prefix check keeps, decoded in one compiled pass where the
    kernel is loaded (the numpy decode made and copied temporary blocks per file: as
    long as the fp8 kernel's pass over the whole file). False where it cannot here."""
    fns = _compiled()
    fn = None if fns is None else fns.get("values " + dtype)
    if fn is None or (dtype == "F8_E4M3" and factor is None):
        return False
    fn(raw, factor, out)
    return True
