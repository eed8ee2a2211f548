"""Rows as values: every format's ``hidden_states`` turned into float32 (fp8: its
float8_e4m3fn values times its token's scale, through a 256-entry table), and a window of
stored rows into the per-row numbers the checks need (squared norm, key, zero and
NaN/Inf flags), by numpy blocks (fp8 in large audits: the compiled kernel, :mod:`.kernel`)."""

from __future__ import annotations

import os
import stat
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
)
from .reports import FileReport

if TYPE_CHECKING:
    from numpy.typing import NDArray


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
        self.raw_dtype = "u1" if self.fp8 else HIDDEN_RAW[dtype]
        self.row_bytes = hidden * ITEMSIZE[dtype]
        self.value_bytes = hidden * (8 if dtype == "F64" else 4)  # a row's decoded values
        self.scales = None if scales is None else np.asarray(scales, dtype=np.float32)
        self.table = fp8_e4m3fn_table() if self.fp8 else None
        # Each row's scale (fp8: a token's n_aux rows share it).
        self.row_scales = None if scales is None else np.repeat(self.scales, n_aux)

    def block(self, raw: Any, row0: int, work: Any) -> tuple[Any, Any]:
        """Values of stored rows ``raw`` ([n, hidden], rows ``row0``... of the file) and
        the unsigned-integer view of the values the row keys are sampled from;
        ``work``: a uint32 block at least as large, reused for BF16 and F16 values."""
        import numpy as np

        if self.fp8:
            values = self.table[raw]  # type: ignore[index]
            values *= self.row_scales[row0 : row0 + raw.shape[0], None]  # type: ignore[index]
            return values, values.view(np.uint32)
        ints = raw.view(HIDDEN_INT[self.dtype])
        if self.dtype == "BF16":  # bf16 is the top half of a float32
            bits = work[: len(raw)]
            bits[...] = ints  # widen, then shift in place (faster than one casting shift)
            np.left_shift(bits, 16, out=bits)
            return bits.view(np.float32), ints
        if self.dtype == "F16":
            values = work[: len(raw)].view(np.float32)
            values[...] = raw
            return values, ints
        return raw, ints

    def canonical(self, stored: bytes, token: int) -> bytes:
        """The bytes of one stored row's values (row of token position ``token``)."""
        if not self.fp8:
            return stored
        import numpy as np

        values = self.table[np.frombuffer(stored, dtype=np.uint8)]  # type: ignore[index]
        return (values * self.scales[token]).tobytes()  # type: ignore[index]


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

    def read(key: str, dtype: str, count: int) -> NDArray[Any]:
        offset = data_start + tensors[key]["data_offsets"][0]
        return np.fromfile(p, dtype=dtype, count=count, offset=offset)

    scales = read(SCALES_KEY, "<f4", n_tokens) if rep.format == FP8 else None
    rows = Rows(tensors[HIDDEN_KEY]["dtype"], hidden, n_aux, scales)
    raw = read(HIDDEN_KEY, rows.raw_dtype, n_tokens * n_aux * hidden)
    ids = read(TOKEN_KEY, "<i8", tensors[TOKEN_KEY]["shape"][0])
    raw = raw.reshape(n_tokens * n_aux, hidden)
    values = np.array(rows.block(raw, 0, np.empty(raw.shape, np.uint32))[0], dtype=np.float32)
    return values.reshape(n_tokens, n_aux, hidden), ids, rep.format or ""


# Audits of fewer bytes use numpy: the kernel's load is repaid only past this size.
# ``KERNEL_ENV=0``: never.
MIN_BYTES = 1024 * 1024 * 1024
KERNEL_ENV = "VLLM_HSFIX_AUDIT_KERNEL"
_kernel: Any = None  # the loaded :mod:`.kernel` once :func:`enable` succeeded; False: failed
_allowed = False  # an audit large enough for it: the first fp8 window loads the kernel


def allow(total_bytes: int) -> None:
    """Let this process's scans load the kernel at their first fp8 window when an audit
    of ``total_bytes`` repays its load: an audit without fp8 files never loads it."""
    global _allowed
    _allowed = total_bytes >= MIN_BYTES


def is_fp8(path: str) -> bool:
    """Whether ``path``'s header says fp8 rows (False for a file it cannot read; only a
    regular file is opened: a FIFO's open would never return)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        tensors = read_layout(path)[3]
    except Exception:
        return False
    hs = tensors.get(HIDDEN_KEY)
    return isinstance(hs, dict) and hs.get("dtype") == FP8_DTYPE


def enable(total_bytes: int) -> bool:
    """Use the compiled fp8 kernel in this process's scans when an audit of ``total_bytes``
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
    file): fp8 from the kernel where it is on and every row is plain, else the values,
    then the per-row numbers of :func:`_block_rows`."""
    import numpy as np

    kernel = rows.fp8 and (_kernel or (_allowed and enable(MIN_BYTES)))
    if kernel and _kernel_rows(nums, raw, rows, row0, cols, mult):
        return
    # Overflow is expected and handled (squares past float32 are summed again in
    # float64; F64 values past float32 make an unsound head row): no warnings.
    with np.errstate(all="ignore"):
        values, ints = rows.block(raw, row0, np.empty(raw.shape, np.uint32))
        _keep_head(nums, row0, values)
        nums.keys[row0 : row0 + len(raw)] = row_keys(ints, cols, mult)
        _block_rows(nums, row0, values)


def _kernel_rows(
    nums: RowNumbers,
    raw: NDArray[Any],
    rows: Rows,
    row0: int,
    cols: NDArray[Any],
    mult: NDArray[Any],
) -> bool:
    """An fp8 window's squared norms, keys and head rows from the compiled kernel;
    False when a row needs :func:`_block_rows`'s closer look."""
    n = raw.shape[0]
    sumsq, keys = nums.sumsq[row0 : row0 + n], nums.keys[row0 : row0 + n]
    scales = rows.row_scales[row0 : row0 + n]  # type: ignore[index]
    if _kernel.fp8(rows.table, raw, scales, cols, mult, sumsq, keys):
        return False
    if row0 < len(nums.head):
        take = min(len(nums.head) - row0, n)
        head = nums.head[row0 : row0 + take]
        _kernel.fp8_values(rows.table, raw[:take], scales[:take], head)
    return True


def _keep_head(nums: RowNumbers, row0: int, work: NDArray[Any]) -> None:
    """Keep the rows of ``work`` (values of rows ``row0``...) that fall in the head."""
    take = min(len(nums.head) - row0, len(work))
    if take > 0:
        nums.head[row0 : row0 + take] = work[:take]
