"""Rows as values: every format's ``hidden_states`` turned into float32 (fp8: its
float8_e4m3fn values times its token's scale, through a 256-entry table)."""

from __future__ import annotations

import os
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
        # Each row's scale (fp8: a token's n_aux rows share it).
        self.row_scales = None if scales is None else np.repeat(self.scales, n_aux)
        # Values widened for the checks: bytes per value of a block's working copy.
        self.work_itemsize = 8 if dtype == "F64" else 4

    def buffer(self, rows: int) -> Any:
        """The working block this format needs (None: F32/F64 read in place, fp8 fresh)."""
        import numpy as np

        if self.dtype == "BF16":
            return np.empty((rows, self.hidden), dtype=np.uint32)
        if self.dtype == "F16":
            return np.empty((rows, self.hidden), dtype=np.float32)
        return None

    def block(self, raw: Any, row0: int, buf: Any) -> tuple[Any, Any]:
        """Values of stored rows ``raw`` ([n, hidden], rows ``row0``... of the file) and
        the unsigned-integer view of the values the row keys are sampled from."""
        import numpy as np

        n = raw.shape[0]
        if self.fp8:
            work = self.table[raw]  # type: ignore[index]
            work *= self.row_scales[row0 : row0 + n, None]  # type: ignore[index]
            return work, work.view(np.uint32)
        ints = raw.view(HIDDEN_INT[self.dtype])
        if self.dtype == "BF16":
            # bf16 is the top half of a float32: widen, shift left 16, reinterpret.
            w = buf[:n]
            w[...] = ints
            np.left_shift(w, 16, out=w)
            return w.view(np.float32), ints
        if self.dtype == "F16":
            work = buf[:n]
            work[...] = raw
            return work, ints
        return raw, ints

    def into(self, raw: Any, out: Any) -> None:
        """The float32 values of stored BF16/F16/F32 rows ``raw`` written straight into
        ``out`` (no working block: the kernel's head rows)."""
        import numpy as np

        if self.dtype == "BF16":
            bits = out.view(np.uint32)
            bits[...] = raw.view(np.uint16)
            bits <<= 16
        else:
            out[...] = raw

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

        work, _ = self.block(raw, 0, self.buffer(raw.shape[0]))
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
