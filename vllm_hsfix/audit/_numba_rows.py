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

_OPTS: dict[str, Any] = {"cache": True, "nogil": True, "fastmath": {"reassoc", "contract"}}
_F32_MAX = float(np.finfo(np.float32).max)


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
    values: Any,
    raw: Any,
    factor: Any,
    cols: Any,
    mult: Any,
    sumsq: Any,
    keys: Any,
) -> bool:  # pragma: no cover - compiled
    """``raw``: float8_e4m3fn bytes [n, hidden]; ``factor`` [n]: each row's scale x
    2**120 (``values`` [256] holds each byte's value x 2**-120, as in :mod:`.decode`).

    Each byte's magnitude is built as float32 bits, the way :mod:`.decode` does, but
    with the exponent bias added so that every value is a normal float32 equal to the
    fp8 value itself: ``(b & 0x7F) << 20`` plus 120 in the exponent field gives
    ``(1 + m/8) 2**(e-7)`` for the normal bytes (``e >= 1``) and ``(1 + m/8) 2**-7``
    for the subnormal ones, whose value ``(m/8) 2**-6`` is twice that minus ``2**-7``
    (exact). Integer operations, a select and a multiply-add per byte, which the
    compiler vectorises (the tables these replaced took a load per byte or pair of
    bytes: 3.9 -> 10.6 GB/s on the same EPYC, in cache). The squares are summed in
    float32 and scaled once; a NaN byte (0x7F / 0xFF) makes the row's sum NaN, a sum
    past float32 is flagged too (the numpy path decides those rows). The keys sample
    the de-quantized values' bits."""
    n, h = raw.shape
    tmp = np.empty(h, np.uint32)
    mag = tmp.view(np.float32)
    half = np.float32(2.0**-7)
    bias = np.uint32(120 << 23)
    one = np.empty(1, np.float32)
    one_bits = one.view(np.uint32)
    odd = False
    for i in range(n):
        r = raw[i]
        for j in range(h):
            tmp[j] = ((np.uint32(r[j]) & np.uint32(0x7F)) << np.uint32(20)) + bias
        acc = np.float32(0.0)
        nan = np.int32(0)
        for j in range(h):
            b = np.int32(r[j]) & np.int32(0x7F)
            f = mag[j]
            v = np.float32(2.0) * (f - half) if b < 8 else f
            acc += v * v
            nan += np.int32(b == 0x7F)
        f = factor[i]
        s = np.float64(f) * 2.0**-120
        total = np.float64(acc) * s * s if nan == 0 else np.nan
        sumsq[i] = total
        odd |= not (total > 0.0 and total < _F32_MAX)
        key = np.uint64(0)
        for k in range(len(cols)):
            one[0] = values[r[cols[k]]] * f
            key += np.uint64(one_bits[0]) * mult[k]
        keys[i] = key
    return odd


@numba.njit(**_OPTS)
def bf16_values(raw: Any, factor: Any, out: Any) -> None:  # pragma: no cover - compiled
    """``raw``: uint16 [n, hidden] bf16 bits -> their float32 values in ``out``."""
    bits = out.view(np.uint32)
    n, h = raw.shape
    for i in range(n):
        for j in range(h):
            bits[i, j] = np.uint32(raw[i, j]) << np.uint32(16)


@numba.njit(**_OPTS)
def fp8_values(raw: Any, factor: Any, out: Any) -> None:  # pragma: no cover - compiled
    """``raw``: float8_e4m3fn bytes [n, hidden] -> their values times the row's scale
    (``factor`` [n]: scale x 2**120) in ``out`` (float32), built from the bits as in
    :func:`fp8`; the product is rounded once, as the numpy decode's is."""
    n, h = raw.shape
    bits = out.view(np.uint32)
    half = np.float32(2.0**-7)
    bias = np.uint32(120 << 23)
    for i in range(n):
        s = np.float32(factor[i] * np.float32(2.0**-120))
        r = raw[i]
        for j in range(h):
            bits[i, j] = ((np.uint32(r[j]) & np.uint32(0x7F)) << np.uint32(20)) + bias
        for j in range(h):
            b = np.int32(r[j])
            m = b & np.int32(0x7F)
            f = out[i, j]
            v = (np.float32(2.0) * (f - half) if m < 8 else f) * s
            v = -v if b & np.int32(0x80) else v
            out[i, j] = np.float32(np.nan) if m == 0x7F else v
