"""fp8 rows' squared norms and keys in one compiled pass over the stored bytes (numba):
what :mod:`.decode` computes with numpy through a 256-entry table, for large audits."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

_OPTS: dict[str, Any] = {"cache": True, "nogil": True, "fastmath": {"reassoc", "contract"}}
_F32_MAX = float(np.finfo(np.float32).max)


@numba.njit(**_OPTS)
def fp8(
    values: Any, raw: Any, scale: Any, cols: Any, mult: Any, sumsq: Any, keys: Any
) -> bool:  # pragma: no cover - compiled
    """``raw``: float8_e4m3fn bytes [n, hidden], ``values`` [256] each byte's value,
    ``scale`` [n] each row's scale. The squares are summed unscaled and scaled once (a
    NaN byte makes the sum NaN); the keys sample the de-quantized values' bits, which
    are the numpy path's (the same float32 product)."""
    n, h = raw.shape
    one = np.empty(1, np.float32)
    one_bits = one.view(np.uint32)
    odd = False
    for i in range(n):
        r = raw[i]
        acc = np.float32(0.0)
        for j in range(h):
            v = values[r[j]]
            acc += v * v
        s = np.float64(scale[i])
        total = np.float64(acc) * s * s
        sumsq[i] = total
        odd |= not (total > 0.0 and total < _F32_MAX)
        key = np.uint64(0)
        for k in range(len(cols)):
            one[0] = values[r[cols[k]]] * scale[i]
            key += np.uint64(one_bits[0]) * mult[k]
        keys[i] = key
    return odd


@numba.njit(**_OPTS)
def fp8_values(values: Any, raw: Any, scale: Any, out: Any) -> None:  # pragma: no cover
    """The de-quantized values of fp8 rows ``raw`` into ``out`` (float32): the head rows
    the prefix check keeps, the same float32 products as the numpy decode."""
    n, h = raw.shape
    for i in range(n):
        s = scale[i]
        for j in range(h):
            out[i, j] = values[raw[i, j]] * s


def warm(values: Any) -> None:
    """Compile (or load numba's cache) now, so a failure is known before any file."""
    c, m, s, k = np.zeros(1, np.intp), np.ones(1, np.uint64), np.zeros(1), np.zeros(1, np.uint64)
    fp8(values, np.zeros((1, 3), np.uint8), np.ones(1, np.float32), c, m, s, k)
    fp8_values(
        values, np.zeros((1, 3), np.uint8), np.ones(1, np.float32), np.zeros((1, 3), np.float32)
    )
