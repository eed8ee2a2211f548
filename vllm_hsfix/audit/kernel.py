"""Every row's squared norm and key in one compiled pass over the stored bits (numba):
what :mod:`.decode` computes with numpy, for large audits."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

_OPTS: dict[str, Any] = {"cache": True, "nogil": True, "fastmath": {"reassoc", "contract"}}
_F32_MAX = float(np.finfo(np.float32).max)


@numba.njit(**_OPTS)
def _key(bits: Any, cols: Any, mult: Any) -> Any:  # pragma: no cover - compiled
    key = np.uint64(0)
    for k in range(len(cols)):
        key += np.uint64(bits[cols[k]]) * mult[k]
    return key


@numba.njit(**_OPTS)
def bf16(raw: Any, cols: Any, mult: Any, sumsq: Any, keys: Any) -> bool:  # pragma: no cover
    """``raw``: uint16 [n, hidden], the stored bf16 bits (the high half of a float32)."""
    n, h = raw.shape
    tmp = np.empty(h, np.uint32)
    val = tmp.view(np.float32)
    odd = False
    for i in range(n):
        for j in range(h):
            tmp[j] = np.uint32(raw[i, j]) << np.uint32(16)
        acc = np.float32(0.0)
        for j in range(h):
            acc += val[j] * val[j]
        sumsq[i] = acc
        odd |= not (acc > 0.0 and acc < np.inf)
        keys[i] = _key(raw[i], cols, mult)
    return odd


@numba.njit(**_OPTS)
def f32(raw: Any, cols: Any, mult: Any, sumsq: Any, keys: Any) -> bool:  # pragma: no cover
    """``raw``: float32 [n, hidden]; the keys sample its bits."""
    n, h = raw.shape
    bits = raw.view(np.uint32)
    odd = False
    for i in range(n):
        acc = np.float32(0.0)
        for j in range(h):
            acc += raw[i, j] * raw[i, j]
        sumsq[i] = acc
        odd |= not (acc > 0.0 and acc < np.inf)
        keys[i] = _key(bits[i], cols, mult)
    return odd


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
    bf16(np.zeros((1, 2), np.uint16), c, m, s, k)
    f32(np.zeros((1, 2), np.float32), c, m, s, k)
    fp8(values, np.zeros((1, 3), np.uint8), np.ones(1, np.float32), c, m, s, k)
    fp8_values(
        values, np.zeros((1, 3), np.uint8), np.ones(1, np.float32), np.zeros((1, 3), np.float32)
    )
