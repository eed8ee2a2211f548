"""The compiled loops behind :mod:`.kernel` (imported only there: importing numba costs
a few hundred milliseconds, which an audit of a few files should not pay).

Each takes one window of stored rows and fills, per row ``i``: ``sumsq[i]``, the sum of
its squared values accumulated in float32 (numba may reorder the sum to vectorise it,
as BLAS does; no other fast-math assumption, so NaN and Inf propagate as IEEE says),
and ``keys[i]``, the scan's row key: the wrapping sum of ``mult[k]`` times the unsigned
bits of the value in column ``cols[k]`` (what :func:`.window.row_keys` computes). Each
returns whether a row needs the closer look of the numpy path (a zero or non-finite
sum); the window is then redone there.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from .decode import FP8_MASK

_OPTS: dict[str, Any] = {"cache": True, "nogil": True, "fastmath": {"reassoc", "contract"}}
_MASK = np.int32(np.uint32(FP8_MASK).view(np.int32))


@numba.njit(**_OPTS)
def _odd(s: Any) -> bool:  # pragma: no cover - compiled
    return not (s > 0.0 and s < np.inf)


@numba.njit(**_OPTS)
def _key(bits: Any, cols: Any, mult: Any) -> Any:  # pragma: no cover - compiled
    """One row's key from its values' unsigned bits ``bits`` [hidden]."""
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
        odd |= _odd(acc)
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
        odd |= _odd(acc)
        keys[i] = _key(bits[i], cols, mult)
    return odd


@numba.njit(**_OPTS)
def fp8(
    raw: Any, factor: Any, cols: Any, mult: Any, sumsq: Any, keys: Any
) -> bool:  # pragma: no cover
    """``raw``: float8_e4m3fn bytes [n, hidden]; ``factor`` [n]: each row's scale x
    2**120 (the bits below are the value x 2**-120, as in :mod:`.decode`); the keys
    sample the de-quantized values' bits. A row with a NaN byte (0x7F / 0xFF) gets NaN."""
    n, h = raw.shape
    tmp = np.empty(h, np.int32)
    val = tmp.view(np.float32)
    one = np.empty(1, np.float32)
    one_bits = one.view(np.uint32)
    odd = False
    for i in range(n):
        top = np.uint8(0)  # the largest byte without its sign: 0x7F only where NaN
        for j in range(h):
            b = raw[i, j]
            tmp[j] = (np.int32(np.int8(b)) << np.int32(20)) & _MASK
            c = b & np.uint8(0x7F)
            top = c if c > top else top
        f = factor[i]
        acc = np.float32(0.0)
        for j in range(h):
            x = val[j] * f
            acc += x * x
        nan = top == np.uint8(0x7F)
        sumsq[i] = np.nan if nan else acc
        odd |= nan or _odd(acc)
        key = np.uint64(0)
        for k in range(len(cols)):
            one[0] = val[cols[k]] * f
            key += np.uint64(one_bits[0]) * mult[k]
        keys[i] = key
    return odd
