"""Auditing one file: its header and keys (:mod:`.format`), then its rows streamed a
window at a time (:mod:`.decode`) and checked, repeats included; never raises, whatever
goes wrong is a finding."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from . import decode, prefix
from .decode import Rows
from .format import (
    FP8,
    HIDDEN_KEY,
    LOCK_SUFFIX,
    SCALES_KEY,
    TOKEN_KEY,
    BadFile,
    check_keys,
    check_layout,
    read_header,
)
from .reports import CORRUPT, PENDING, SUSPECT, FileReport, LayerStats, attribute

if TYPE_CHECKING:
    from numpy.typing import NDArray

# A window: the rows read at once into one reused buffer, as many as make this many bytes
# of float32 (F64: float64) values, which then stay in the CPU caches. Reads, not a memory
# map: a file that shrinks mid-scan is a short read, a finding, not a SIGBUS.
WINDOW_BYTES = 1024 * 1024
_local = threading.local()  # the window buffer (:func:`_window_buffer`)
# A row whose norm is under this fraction of its layer's median is "near zero".
NEAR_ZERO_FRACTION = 1e-3


def _read_exact(f: Any, view: memoryview) -> None:
    """Fill ``view`` from ``f`` (a short read: the file changed while read)."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise BadFile("truncated", f"file changed while read ({got} of {len(view)} bytes)")
        got += n


def _window_buffer(nbytes: int) -> NDArray[Any]:
    """This thread's window buffer, at least ``nbytes``: one for every file (a fresh one
    is faulted in and zeroed page by page, a cost as large as the read itself)."""
    import numpy as np

    buf = getattr(_local, "window", None)
    if buf is None or len(buf) < nbytes:
        buf = _local.window = np.empty(nbytes, dtype=np.uint8)
    return buf[:nbytes]


def _finite(x: Any) -> float | None:
    """A statistic as a JSON-safe float: ``None`` where F64 norms overflowed."""
    v = float(x)
    return v if math.isfinite(v) else None


def scan_rows(
    rep: FileReport,
    f: Any,
    offset: int,
    rows: Rows,
    shape: tuple[int, int, int],
    ids: NDArray[Any] | None,
) -> None:
    """The row checks of a file whose header was found sound: ``hidden_states`` (at
    ``offset`` of the open file ``f``, ``shape`` tokens x n_aux x hidden) streamed
    window by window."""

    n_tokens, n_aux, hidden = shape
    n_rows = n_tokens * n_aux
    with_prefix = ids is not None and len(ids) == n_tokens
    scan = decode.RowNumbers(n_rows, prefix.PREFIX_ROWS * n_aux if with_prefix else 0, hidden)
    cols, mult = decode.key_columns(hidden)
    # Whole tokens per window, so a window never splits a token's rows.
    tokens_per_window = max(1, min(n_tokens, WINDOW_BYTES // (n_aux * rows.value_bytes)))
    buffer = _window_buffer(tokens_per_window * n_aux * rows.row_bytes)
    f.seek(offset)
    for t0 in range(0, n_tokens, tokens_per_window):
        n = (min(n_tokens, t0 + tokens_per_window) - t0) * n_aux
        part = buffer[: n * rows.row_bytes]
        _read_exact(f, memoryview(part))
        raw = part.view(rows.raw_dtype).reshape(n, hidden)
        decode.fill(scan, raw, rows, t0 * n_aux, cols, mult)
    _row_findings(rep, scan, f.fileno(), offset, rows, shape, ids)


def _row_findings(
    rep: FileReport,
    scan: decode.RowNumbers,
    fd: int,
    offset: int,
    rows: Rows,
    shape: tuple[int, int, int],
    token_ids: NDArray[Any] | None,
) -> None:
    """The findings and statistics of a file from its rows' numbers."""
    import numpy as np

    n_tokens, n_aux, _ = shape
    n_rows = n_tokens * n_aux
    rep.nan_count, rep.inf_count = scan.nan, scan.inf
    zero = scan.zero.reshape(n_tokens, n_aux)
    bad = scan.bad.reshape(n_tokens, n_aux)
    norms = np.sqrt(scan.sumsq).reshape(n_tokens, n_aux)
    rep.zero_rows = int(zero.sum())
    if rep.zero_rows:
        first = int(np.flatnonzero(zero.any(axis=1))[0])
        layers = {a: int(zero[:, a].sum()) for a in range(n_aux) if zero[:, a].any()}
        rep.add(
            "zero_rows",
            CORRUPT,
            f"{rep.zero_rows} of {n_rows} rows are all zero (per aux slot {layers}; "
            f"first at token position {first})",
        )
    if scan.nan or scan.inf:
        rep.add(
            "nonfinite",
            CORRUPT,
            f"{scan.nan} NaN and {scan.inf} Inf values in {int(bad.sum())} rows",
        )
    ids = token_ids if token_ids is not None else np.arange(n_tokens)
    keys = scan.keys.reshape(n_tokens, n_aux)
    skip = zero | bad
    dups = duplicates(rep, keys, skip, fd, offset, rows, ids)
    identical_aux(rep, keys, skip, fd, offset, rows.row_bytes)

    rep.layers += _layer_stats(norms, zero, bad, dups)
    if token_ids is not None and len(token_ids) == n_tokens and n_tokens:
        rep.prefix = prefix.from_head(scan.head, shape, token_ids, zero, bad)  # type: ignore[arg-type]
    rep.duplicate_rows = sum(dups)
    rep.near_zero_rows = sum(st.near_zero_rows for st in rep.layers)
    if rep.near_zero_rows:
        layers = {st.aux: st.near_zero_rows for st in rep.layers if st.near_zero_rows}
        rep.add(
            "near_zero_rows",
            SUSPECT,
            f"{rep.near_zero_rows} rows have a norm under {NEAR_ZERO_FRACTION:g} x their "
            f"slot's median (per aux slot {layers})",
        )


# Rows that repeat: one row at several token ids, one state in two aux layers; equal
# cheap keys confirmed on the rows themselves.


def duplicates(
    rep: FileReport,
    keys: NDArray[Any],
    skip: NDArray[Any],
    fd: int,
    offset: int,
    rows: Rows,
    token_ids: NDArray[Any],
) -> list[int]:
    """Count rows identical to a row of a *different token id* in the same aux layer.

    Same-token repeats are left alone: a layer close to the embeddings can legitimately
    give one token id the same vector at every position. Candidates (equal cheap keys)
    are re-read from ``fd`` and confirmed by a blake2b digest of the whole row's
    values."""
    import numpy as np

    n_aux = keys.shape[1]
    row_bytes = rows.row_bytes
    per_layer = [0] * n_aux
    if not skip.any():  # nearly every file: one sort says no key repeats in any layer
        srt = np.sort(keys, axis=0)
        if not (srt[1:] == srt[:-1]).any():
            return per_layer
    examples: list[str] = []
    for a in range(n_aux):
        pos = np.flatnonzero(~skip[:, a])
        k = keys[pos, a]
        order = np.argsort(k, kind="stable")
        ks = k[order]
        same = ks[1:] == ks[:-1]
        if not same.any():
            continue
        cand = np.zeros(len(ks), dtype=bool)
        cand[1:] |= same
        cand[:-1] |= same
        groups: dict[bytes, list[int]] = {}
        for t in pos[order[cand]].tolist():
            data = os.pread(fd, row_bytes, offset + (t * n_aux + a) * row_bytes)
            data = rows.canonical(data, t)
            digest = hashlib.blake2b(data, digest_size=16).digest()
            groups.setdefault(digest, []).append(t)
        for ts in groups.values():
            if len(ts) > 1 and len({int(token_ids[t]) for t in ts}) > 1:
                per_layer[a] += len(ts) - 1
                if len(examples) < 3:
                    examples.append(f"aux slot {a}: token positions {sorted(ts)[:4]}")
    total = sum(per_layer)
    if total:
        rep.add(
            "duplicate_rows",
            SUSPECT,
            f"{total} rows repeat a row of a different token in the same aux slot "
            f"(e.g. {'; '.join(examples)})",
        )
    return per_layer


def identical_aux(
    rep: FileReport,
    keys: NDArray[Any],
    skip: NDArray[Any],
    fd: int,
    offset: int,
    row_bytes: int,
) -> None:
    """Two aux layers holding the same row at every token position: one state saved
    into two slots (two different layers of a real model never agree everywhere).
    Equal keys at every sound position, confirmed byte for byte on the first and last
    of them."""
    import numpy as np

    n_tokens, n_aux = keys.shape  # one token's rows share a scale: bytes suffice
    if n_aux < 2 or n_tokens < 2:
        return
    pairs = [(a, b) for a in range(n_aux) for b in range(a + 1, n_aux)]
    if not skip.any():  # every row sound: only layers whose first keys agree can match
        first = keys[0].tolist()
        pairs = [(a, b) for a, b in pairs if first[a] == first[b]]
    for a, b in pairs:
        sound = np.flatnonzero(~(skip[:, a] | skip[:, b]))
        if len(sound) < 2 or not (keys[sound, a] == keys[sound, b]).all():
            continue
        same = all(
            os.pread(fd, row_bytes, offset + (t * n_aux + a) * row_bytes)
            == os.pread(fd, row_bytes, offset + (t * n_aux + b) * row_bytes)
            for t in (int(sound[0]), int(sound[-1]))
        )
        if same:
            rep.add(
                "aux_layers_identical",
                CORRUPT,
                f"aux slots {a} and {b} hold identical rows at all {len(sound)} "
                "token positions (unless the file was written with one aux layer id "
                "twice)",
            )
            return


def _layer_stats(
    norms: NDArray[Any], zero: NDArray[Any], bad: NDArray[Any], dups: list[int]
) -> list[LayerStats]:
    """Per aux layer, statistics of its sound rows' norms ([tokens, n_aux] inputs); when
    every row is sound (nearly every file), one call over all layers."""
    skip = zero | bad
    if len(norms) and not skip.any():
        return _sound_stats(norms, dups)
    out = []
    for a in range(norms.shape[1]):
        v = norms[~skip[:, a], a : a + 1]
        if len(v):
            st = _sound_stats(v, dups[a : a + 1])[0]
        else:
            st = LayerStats(a, 0, None, None, None, None, None, duplicate_rows=dups[a])
        st.aux = a
        st.zero_rows, st.nonfinite_rows = int(zero[:, a].sum()), int(bad[:, a].sum())
        out.append(st)
    return out


def _sound_stats(norms: NDArray[Any], dups: list[int]) -> list[LayerStats]:
    """Each layer's statistics of ``norms`` [rows, n_aux], every row sound: one sort
    gives np.median's median, the minimum and the maximum."""
    import numpy as np

    n = len(norms)
    srt = np.sort(norms, axis=0)
    med = srt[n // 2] if n % 2 else (srt[n // 2 - 1] + srt[n // 2]) / 2
    mean = np.add.reduce(norms, axis=0) / n
    std = np.sqrt(np.add.reduce(np.square(norms - mean), axis=0) / n)
    near = (norms < NEAR_ZERO_FRACTION * med).sum(axis=0).tolist()
    columns = zip(
        med.tolist(), mean.tolist(), std.tolist(), srt[0].tolist(), srt[-1].tolist(), strict=True
    )
    return [
        LayerStats(
            aux=a,
            count=n,
            mean_norm=_finite(avg),
            std_norm=_finite(sd),
            median_norm=_finite(middle),
            min_norm=_finite(lo),
            max_norm=_finite(hi),
            duplicate_rows=dups[a],
            near_zero_rows=int(near[a]),
        )
        for a, (middle, avg, sd, lo, hi) in enumerate(columns)
    ]


def _judge(rep: FileReport, path: str) -> None:
    """Read ``path``'s header and judge its layout and keys into ``rep``, then its rows
    where there are rows to read (one open file throughout)."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        rep.bytes = size
        header, data_start = read_header(f, size)
        meta = header.get("__metadata__")
        if isinstance(meta, dict):
            rep.provenance = {k: str(v) for k, v in meta.items() if k.startswith("vllm_hsfix.")}
        tensors, layout = check_layout(header, size - data_start)
        if layout is not None:
            rep.add(layout.code, layout.severity, _lock_note(layout.code, layout.detail, path))
        hs_ok, ti_ok = check_keys(rep, tensors)
        if layout is not None and layout.code == "truncated":
            return  # the data the header points at is not all there: reading it hits EOF
        token_ids = None
        if ti_ok:
            ti = tensors[TOKEN_KEY]
            token_ids = _read_at(f, data_start + ti["data_offsets"][0], ti["shape"][0], "<i8")
        if not hs_ok:
            return
        hs = tensors[HIDDEN_KEY]
        shape = (rep.n_tokens or 0, rep.n_aux or 0, rep.hidden or 0)
        scales = None
        if rep.format == FP8:
            sc = tensors[SCALES_KEY]
            scales = _read_at(f, data_start + sc["data_offsets"][0], sc["shape"][0], "<f4")
            _check_scale_values(rep, scales)
        rows = Rows(hs["dtype"], shape[2], shape[1], scales)
        scan_rows(rep, f, data_start + hs["data_offsets"][0], rows, shape, token_ids)


def _read_at(f: Any, offset: int, n: int, dtype: str) -> NDArray[Any]:
    """``n`` values of ``dtype`` at ``offset`` of the open file ``f``."""
    import numpy as np

    out = np.empty(n, dtype)
    f.seek(offset)
    _read_exact(f, memoryview(out.view(np.uint8)))
    return out


def _check_scale_values(rep: FileReport, scales: NDArray[Any]) -> None:
    """fp8: the connector's scales are finite and positive (amax / 448, at least
    1e-12); any other is damage (its rows are then judged as de-quantized, too)."""
    import numpy as np

    bad = ~(np.isfinite(scales) & (scales > 0))
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        rep.add(
            "bad_scales",
            CORRUPT,
            f"{int(bad.sum())} of {len(scales)} {SCALES_KEY} are not finite and positive "
            f"(first at token position {first}: {float(scales[first])!r})",
        )


def writer_holds_lock(path: str) -> bool:
    """Whether the connector's writer still holds ``path.lock``: the file outlives the
    write, its ``LOCK_EX`` does not (a non-blocking shared lock is refused while held)."""
    try:
        import fcntl
    except ImportError:  # no flock on this platform: nothing can be known
        return False
    try:
        fd = os.open(path + LOCK_SUFFIX, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False  # a filesystem without flock: judge the file
    finally:
        os.close(fd)  # also releases our shared lock, if we got it
    return False


def locked(path: str) -> FileReport | None:
    """A ``pending`` report while the writer still holds the file's lock, else None:
    judging a half-written file would call it truncated."""
    if not writer_holds_lock(path):
        return None
    rep = FileReport(path=path)
    with contextlib.suppress(OSError):
        rep.bytes = os.path.getsize(path)
    rep.add(
        "locked",
        PENDING,
        f"its writer holds {os.path.basename(path)}{LOCK_SUFFIX}: still being written; "
        "not judged (audit again when the writer is done)",
    )
    return rep


def audit_file(path: str | os.PathLike[str]) -> FileReport:
    """Audit one file. Never raises: whatever goes wrong becomes a finding, so one bad
    file cannot hide the verdicts of the thousands after it."""
    t0 = time.perf_counter()
    rep = FileReport(path=os.fspath(path))
    try:
        _judge(rep, rep.path)
    except BadFile as exc:
        rep.add(exc.code, exc.severity, _lock_note(exc.code, exc.detail, rep.path))
    except OSError as exc:
        rep.add("unreadable", CORRUPT, f"cannot read: {exc.strerror or exc}")
    except Exception as exc:  # MemoryError, numpy errors on hostile headers, ...
        rep.add("unreadable", CORRUPT, f"audit failed: {exc!r}")
    attribute(rep)  # the hazards its findings carry the signature of
    rep.seconds = time.perf_counter() - t0
    return rep


def _lock_note(code: str, detail: str, path: str) -> str:
    """A truncated file's detail says so when a ``.lock`` sits beside it."""
    if code == "truncated" and os.path.exists(path + LOCK_SUFFIX):
        detail += " (a .lock file sits beside it: the writer may still be running)"
    return detail
