"""Rows as values, in one place: every format's ``hidden_states`` turned into float32.

Every check judges values, never stored bytes: the streamed scan (:mod:`.scan`: zeros,
NaN/Inf, norms, duplicates, the prefix sketches that ``--state`` and Ray carry) takes
its blocks from :meth:`Rows.block`, and ``--reference`` reads whole files through
:func:`read_rows`. For ``fp8`` files (hs-connectors' ``FP8HiddenStatesConnector``) a
row's values are its float8_e4m3fn values times its token's scale, exactly what the
consumer (``FP8Transfer``) computes; for the other dtypes they are the values widened
to float32 (F64 stays F64).

float8_e4m3fn is decoded with a 256-entry table (numpy has no fp8 dtype, and the audit
needs no torch): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, subnormals at
exponent 0, no infinities, ``0x7F`` and ``0xFF`` NaN; the largest value is 448. The
scan looks two bytes up at once (a 65536-entry table of value pairs, 512 KB): numpy's
gather costs per index, so pairs decode about twice as fast as single bytes.
"""

from __future__ import annotations

import os
import sys
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from .format import (
    FP8,
    FP8_DTYPE,
    HIDDEN_INT,
    HIDDEN_KEY,
    HIDDEN_RAW,
    ITEMSIZE,
    SCALES_KEY,
    TOKEN_KEY,
    BadFile,
    check_keys,
    read_layout,
    read_token_ids,
)
from .reports import FileReport

if TYPE_CHECKING:
    from numpy.typing import NDArray

# A file's data section read at once: (its offset in the file, the bytes).
Whole = tuple[int, bytes]


@lru_cache(maxsize=1)
def fp8_e4m3fn_table() -> NDArray[Any]:
    """The float32 value of each of the 256 float8_e4m3fn bit patterns."""
    import numpy as np

    b = np.arange(256)
    exp = (b >> 3) & 0xF
    man = (b & 0x7).astype(np.float64)
    mag = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * np.exp2(exp - 7.0))
    val = np.where(b & 0x80, -mag, mag)
    val[(b & 0x7F) == 0x7F] = np.nan
    return val.astype(np.float32)


@lru_cache(maxsize=1)
def fp8_pair_table() -> NDArray[Any]:
    """The two float32 values of every little-endian pair of float8_e4m3fn bytes, as
    one uint64 per pair (index ``first | second << 8``)."""
    import numpy as np

    t = fp8_e4m3fn_table()
    pairs = np.empty((256, 256, 2), dtype=np.float32)
    pairs[:, :, 0] = t[None, :]  # the first byte is the low one of the index
    pairs[:, :, 1] = t[:, None]
    return pairs.reshape(65536, 2).view(np.uint64).reshape(65536)


# float8_e4m3fn byte b, sign-extended to int32 and shifted left 20, then masked with
# this: its sign in the float32 sign bit, its exponent and mantissa in the low exponent
# and high mantissa bits: the float32 of exactly b's value x 2**-120 (subnormals and
# zeros included), so one multiply by scale x 2**120 gives value x scale with one
# rounding, as the table does. Only 0x7F / 0xFF (NaN) need fixing up afterwards.
FP8_MASK = 0x87F00000
_FP8_SHIFT = 2.0**120


@lru_cache(maxsize=1)
def fp8_bits_exact() -> bool:
    """Whether the bit-construction decode gives the table's values here, all 256 bytes
    (it relies on float32 subnormals not being flushed to zero)."""
    import numpy as np

    b = np.arange(256, dtype=np.uint8)
    got = _fp8_bits(b[None, :], np.ones((1, 1), np.float32) * np.float32(_FP8_SHIFT))
    return bool(np.array_equal(got, fp8_e4m3fn_table()[None, :], equal_nan=True))


def _fp8_bits(raw: Any, factor: Any, i32: Any = None, tmp: Any = None) -> Any:
    """fp8 bytes ``raw`` [n, hidden] times ``factor`` [n, 1] (scale x 2**120) as float32,
    through ``i32`` / ``tmp`` scratch blocks when given (see ``FP8_MASK``)."""
    import numpy as np

    if i32 is None:
        i32, tmp = np.empty(raw.shape, np.int32), np.empty(raw.shape, np.uint8)
    np.copyto(i32, raw.view(np.int8), casting="unsafe")
    np.left_shift(i32, 20, out=i32)
    np.bitwise_and(i32, np.uint32(FP8_MASK).view(np.int32), out=i32)
    work = i32.view(np.float32)
    np.multiply(work, factor, out=work)
    np.bitwise_and(raw, 0x7F, out=tmp)
    if tmp.size and tmp.max() == 0x7F:
        work[tmp == 0x7F] = np.nan
    return work


def read_scales(
    path: str, tensors: dict[str, Any], data_start: int, whole: Whole | None = None
) -> NDArray[Any]:
    """An fp8 file's per-token scales, float32 ``[tokens]``."""
    import numpy as np

    sc = tensors[SCALES_KEY]
    start, n = data_start + sc["data_offsets"][0], sc["shape"][0]
    if whole is not None:
        return np.frombuffer(whole[1], "<f4", n, start - whole[0])
    return np.fromfile(path, dtype="<f4", count=n, offset=start)


class Rows:
    """How one file's ``hidden_states`` rows (``n_aux`` per token) become values.

    ``raw_dtype`` is what the stored rows are mapped as; :meth:`block` turns a block of
    them into float32 (F64: float64) values plus the integer view the row keys sample;
    :meth:`canonical` turns one stored row into the bytes of its values (what the
    duplicate checks compare: for fp8, two rows are the same only with the same scale)."""

    def __init__(self, dtype: str, hidden: int, n_aux: int, scales: Any = None) -> None:
        import numpy as np

        self.dtype = dtype
        self.fp8 = dtype == FP8_DTYPE
        if self.fp8 and scales is None:
            raise ValueError("fp8 rows need their scales")
        self.hidden = hidden
        self.n_aux = n_aux
        self.raw_dtype = "u1" if self.fp8 else HIDDEN_RAW[dtype]
        self.row_bytes = hidden * ITEMSIZE[dtype]
        self.scales = None if scales is None else np.asarray(scales, dtype=np.float32)
        self.table = fp8_e4m3fn_table() if self.fp8 else None
        # fp8, the fast decode (a few integer operations and one multiply per value,
        # 3x the pair table's speed) where every scale is a sound float32 whose
        # 2**120 multiple is finite; else the pair table (a gather per 2 bytes).
        self._factor: Any = None
        if self.fp8 and self.scales is not None and sys.byteorder == "little":
            sc = self.scales
            sound = bool(((sc > 0) & (sc < 2.0**7)).all())  # NaN fails both
            if sound and fp8_bits_exact():
                factor = sc * np.float32(_FP8_SHIFT)
                self._factor = np.repeat(factor, n_aux)[:, None]
        pairs = self.fp8 and hidden % 2 == 0 and sys.byteorder == "little"
        self.pairs = fp8_pair_table() if pairs and self._factor is None else None
        # Values widened for the checks: bytes per value of a block's working copy.
        self.work_itemsize = 8 if dtype == "F64" else 4
        self._row_scales: Any = None

    def buffer(self, rows: int) -> Any:
        """The working block this format needs (None: F32/F64 are read in place)."""
        import numpy as np

        if self.dtype == "BF16":
            return np.empty((rows, self.hidden), dtype=np.uint32)
        if self.dtype == "F16":
            return np.empty((rows, self.hidden), dtype=np.float32)
        if self._factor is not None:
            return (
                np.empty((rows, self.hidden), dtype=np.int32),
                np.empty((rows, self.hidden), dtype=np.uint8),
            )
        return None  # F32/F64 are read in place; table-decoded fp8 into a fresh array

    def block(self, raw: Any, row0: int, buf: Any) -> tuple[Any, Any]:
        """Values of stored rows ``raw`` ([n, hidden], rows ``row0``... of the file) and
        the unsigned-integer view of the values the row keys are sampled from."""
        import numpy as np

        n = raw.shape[0]
        if self._factor is not None:
            work = _fp8_bits(raw, self._factor[row0 : row0 + n], buf[0][:n], buf[1][:n])
            return work, work.view(np.uint32)
        if self.fp8:
            if self._row_scales is None:
                self._row_scales = np.repeat(self.scales, self.n_aux)
            if self.pairs is not None:
                work = self.pairs[raw.view(np.uint16)].view(np.float32)
            else:
                work = self.table[raw]  # type: ignore[index]
            work *= self._row_scales[row0 : row0 + n, None]
            return work, work.view(np.uint32)
        ints = raw.view(HIDDEN_INT[self.dtype])
        if self.dtype == "BF16":
            # bf16 is the top half of a float32: widen, shift left 16, reinterpret
            # (a plain copy then an in-place shift: a shift that casts as it goes
            # takes numpy's buffered path, a quarter slower).
            w = buf[:n]
            w[...] = ints
            np.left_shift(w, 16, out=w)
            return w.view(np.float32), ints
        if self.dtype == "F16":
            work = buf[:n]
            work[...] = raw
            return work, ints
        return raw, ints

    def factor(self, row0: int, n: int) -> Any:
        """fp8 rows ``row0``.. ``row0 + n``: each row's scale x 2**120 (float32 [n]) for
        the bit-construction decode, or None where that decode is not used here."""
        if self._factor is None:
            return None
        return self._factor[row0 : row0 + n, 0]

    def canonical(self, stored: bytes, token: int) -> bytes:
        """The bytes of one stored row's values (row of token position ``token``)."""
        if not self.fp8:
            return stored
        import numpy as np

        values = self.table[np.frombuffer(stored, dtype=np.uint8)]  # type: ignore[index]
        return (values * self.scales[token]).tobytes()  # type: ignore[index]

    def values(self, raw: Any) -> Any:
        """All rows at once ([tokens x n_aux, hidden] stored) as float32 values."""
        import numpy as np

        buf = self.buffer(raw.shape[0])
        work, _ = self.block(raw, 0, buf)
        return np.array(work, dtype=np.float32)


def read_rows(path: str | os.PathLike[str], tokens: int | None = None) -> tuple[Any, Any, str]:
    """A whole file as values: float32 ``[tokens, n_aux, hidden]``, the token ids
    (int64) and the format name. For ``--reference`` (whole files of a sample) and
    repair's comparison; ``tokens``: only the first that many token positions' rows.
    Raises ``BadFile`` for a file the checks cannot read or judge (the reason in it)."""
    import numpy as np

    p = os.fspath(path)
    _, _, data_start, tensors, layout = read_layout(p)
    if layout is not None:
        raise BadFile(layout.code, layout.detail, layout.severity)
    rep = FileReport(path=p)
    hs_ok, ti_ok = check_keys(rep, tensors)
    if not (hs_ok and ti_ok):
        worst = next((q for q in rep.problems if q.severity == rep.verdict), rep.problems[0])
        raise BadFile(worst.code, rep.reason(), rep.verdict)
    n_tokens, n_aux, hidden = rep.n_tokens or 0, rep.n_aux or 0, rep.hidden or 0
    if tokens is not None:
        n_tokens = min(n_tokens, tokens)
    scales = read_scales(p, tensors, data_start) if rep.format == FP8 else None
    rows = Rows(tensors[HIDDEN_KEY]["dtype"], hidden, n_aux, scales)
    raw = np.fromfile(
        p,
        dtype=rows.raw_dtype,
        count=n_tokens * n_aux * hidden,
        offset=data_start + tensors[HIDDEN_KEY]["data_offsets"][0],
    ).reshape(n_tokens * n_aux, hidden)
    ti = tensors[TOKEN_KEY]
    ids = read_token_ids(p, data_start + ti["data_offsets"][0], ti["shape"][0])
    return rows.values(raw).reshape(n_tokens, n_aux, hidden), ids, rep.format or ""
