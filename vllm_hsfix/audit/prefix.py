"""Shared-prefix consistency: files whose prompts start with the same token ids must
hold the same first rows; per group a majority consensus of row sketches is formed and
files that disagree are flagged (docs/audit.md)."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from numpy.typing import NDArray

Tick = Callable[[int], None]  # progress: ``tick(n)`` after n more files are done

PREFIX_ROWS = 16
SKETCH_DIM = 32
# Agreeing rows differ by batch noise, rows from other blocks' memory by 1.0 and more
# (relative L2; docs/audit.md): the tolerance sits between, with room for the sketch's
# own error.
TOLERANCE = 0.3
CONSENSUS_SAMPLE = 16
_SEED = 0x48534658


@lru_cache(maxsize=8)
def sketch_matrix(hidden: int) -> NDArray[Any]:
    """The fixed projection for rows of width ``hidden`` (same in every worker)."""
    import numpy as np

    rng = np.random.default_rng([_SEED, hidden])
    return (rng.standard_normal((hidden, SKETCH_DIM)) / np.sqrt(SKETCH_DIM)).astype(np.float32)


@contextlib.contextmanager
def single_blas_thread() -> Iterator[bool]:
    """BLAS on one thread inside (``threadpoolctl``, which finds every BLAS loaded by
    then); yields whether that was arranged (a large product makes OpenBLAS start
    threads that spin, slowing parallel workers)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield False
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield True


def sketch_rows(rows: NDArray[Any]) -> NDArray[Any]:
    """``rows`` [tokens, n_aux, hidden] (float32) -> sketches [tokens, n_aux, SKETCH_DIM],
    one 2-D product."""
    matrix = sketch_matrix(rows.shape[-1])
    return (rows.reshape(-1, rows.shape[-1]) @ matrix).reshape(*rows.shape[:-1], SKETCH_DIM)


@dataclass
class PrefixData:
    """What one file contributes: its first token ids, their row sketches, and which of
    those rows are sound (finite and not all zero)."""

    token_ids: tuple[int, ...]
    sketches: Any  # float16 unit vectors [len(token_ids), n_aux, SKETCH_DIM]
    norms: Any  # float32 [len(token_ids), n_aux]: sketch = unit vector x norm
    sound: Any  # bool [len(token_ids), n_aux]
    shape_key: tuple[int, int]  # (n_aux, hidden): only like files are compared


def from_head(
    head: NDArray[Any],
    shape: tuple[int, int, int],
    token_ids: NDArray[Any],
    zero: NDArray[Any],
    bad: NDArray[Any],
) -> PrefixData:
    """One file's contribution from its first rows as the scan saw them (``head``,
    float32 [tokens x n_aux, hidden]); ``zero`` / ``bad`` mark the rows already judged.
    Unit sketches go in float16 (half the transfer from the workers), norms in float32
    (activations of large models overflow float16 themselves)."""
    import numpy as np

    n_tokens, n_aux, hidden = shape
    k = min(n_tokens, PREFIX_ROWS)
    rows = head.reshape(k, n_aux, hidden)
    sound = ~(zero[:k] | bad[:k])
    if not sound.all():  # unsound rows must not reach the sketch (NaN would spread)
        rows = np.where(sound[..., None], rows, 0.0).astype(np.float32)
    with np.errstate(all="ignore"):  # huge rows overflow: their norm is inf, not sound
        sketch = sketch_rows(rows)
        norms = np.sqrt(np.einsum("...i,...i->...", sketch, sketch))
        finite = np.isfinite(norms)
        sound &= finite
        unit = sketch / np.where(norms > 0, norms, 1.0)[..., None]
    if not finite.all():
        unit = np.nan_to_num(unit)
    return PrefixData(
        tuple(token_ids[:k].tolist()),
        unit.astype(np.float16),
        np.where(sound, norms, 0.0).astype(np.float32),
        sound,
        (n_aux, hidden),
    )


@dataclass
class PrefixFinding:
    index: int  # the file's index in the input list
    position: int
    aux: int
    distance: float | None  # None when the group had no consensus
    group_size: int


@dataclass
class PrefixResult:
    findings: dict[int, PrefixFinding] = field(default_factory=dict)
    checked: int = 0  # files that share at least their first token with another file
    groups: int = 0
    no_consensus_groups: int = 0
    max_agreeing_distance: float = 0.0  # the spread seen among agreeing rows

    def summary(self, total: int) -> dict[str, Any]:
        return {
            "positions": PREFIX_ROWS,
            "tolerance": TOLERANCE,
            "files_checked": self.checked,
            "files_unchecked": total - self.checked,
            "groups": self.groups,
            "groups_without_consensus": self.no_consensus_groups,
            "files_flagged": len(self.findings),
            "max_agreeing_distance": round(self.max_agreeing_distance, 4),
        }


# Files gathered in memory before their sketches are appended to the position files.
CHUNK = 1024


def _spill_file() -> IO[bytes]:
    """An unnamed temporary file, or memory where none can be made (never an error)."""
    try:
        return tempfile.TemporaryFile(prefix="vllm-hsfix-prefix-", buffering=0)
    except OSError:
        return io.BytesIO()


class Columns:
    """The files of one ``[n_aux, hidden]`` shape. In memory, per file: its index in the
    audit, its prefix token ids (-1 past its end) and which rows are sound; each
    position's sketches (float16 unit vectors and float32 norms) go to a temporary file
    of that position, read back whole one position at a time by :meth:`rows`."""

    def __init__(self, n_aux: int) -> None:
        import numpy as np

        self.n_aux, self.n = n_aux, 0
        self.cell = np.dtype(
            [("units", np.float16, (n_aux, SKETCH_DIM)), ("norms", np.float32, n_aux)]
        )
        self.index = np.zeros(0, np.int64)
        self.length = np.zeros(0, np.uint8)
        self.tokens = np.zeros((0, PREFIX_ROWS), np.int64)
        self.sound = np.zeros((0, PREFIX_ROWS, n_aux), bool)
        self._chunk = np.zeros((PREFIX_ROWS, CHUNK), self.cell)
        self._units, self._norms = self._chunk["units"], self._chunk["norms"]  # once: not per file
        self._filled = 0
        self._spill = [_spill_file() for _ in range(PREFIX_ROWS)]
        self._stored = 0  # files whose sketches are in the position files
        self._loaded: tuple[int, Any] = (-1, None)

    def append(self, index: int, p: PrefixData) -> None:
        """File ``index``'s contribution (its first ``k`` token ids and sketches)."""
        import numpy as np

        if self.n == len(self.index):
            grow = max(256, self.n // 2)
            for name in ("index", "length", "tokens", "sound"):
                old = getattr(self, name)
                setattr(
                    self, name, np.concatenate([old, np.zeros((grow, *old.shape[1:]), old.dtype)])
                )
        r, k = self.n, len(p.token_ids)
        self.index[r], self.length[r] = index, k
        self.tokens[r, :k] = p.token_ids
        self.tokens[r, k:] = -1
        self.sound[r, :k] = p.sound
        self._units[:k, self._filled] = p.sketches
        self._norms[:k, self._filled] = p.norms
        self._filled += 1
        self.n += 1
        if self._filled == CHUNK:
            self._flush()

    def _flush(self) -> None:
        """The chunk's sketches appended to each position's file; a file that cannot be
        written (a full disk) is moved to memory with what it held."""
        size = self._stored * self.cell.itemsize
        for p, f in enumerate(self._spill):
            data = self._chunk[p, : self._filled].tobytes()
            try:
                view = memoryview(data)
                while view:  # an unbuffered write may take part of it
                    view = view[f.write(view) or 0 :]
            except OSError:
                held = io.BytesIO(os.pread(f.fileno(), size, 0))
                f.close()
                held.seek(0, io.SEEK_END)
                held.write(data)
                self._spill[p] = held
        self._stored += self._filled
        self._filled = 0

    def rows(self, sel: NDArray[Any], position: int) -> NDArray[Any]:
        """The sketches of files ``sel`` (row numbers here) at ``position``: float32
        ``[len(sel), n_aux, SKETCH_DIM]``."""
        import numpy as np

        if self._filled:
            self._flush()
        if self._loaded[0] != position:
            f = self._spill[position]
            data = (
                f.getvalue()
                if isinstance(f, io.BytesIO)
                else os.pread(f.fileno(), self._stored * self.cell.itemsize, 0)
            )
            self._loaded = (position, np.frombuffer(data, self.cell))
        cells = self._loaded[1][sel]
        return cells["units"].astype(np.float32) * cells["norms"][:, :, None]

    def close(self) -> None:
        self._loaded = (-1, None)
        for f in self._spill:
            f.close()


class Store(dict[tuple[int, int], Columns]):
    """Every file's contribution to the check, by ``[n_aux, hidden]`` shape, as the files
    are judged (the reports themselves can then be dropped): :func:`check` reads it."""

    def add(self, index: int, p: PrefixData | None) -> None:
        """File ``index``'s contribution (None or no token ids: nothing to compare)."""
        if p is not None and p.token_ids:
            if p.shape_key not in self:
                self[p.shape_key] = Columns(p.shape_key[0])
            self[p.shape_key].append(index, p)

    def close(self) -> None:
        for cols in self.values():
            cols.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _distance(a: NDArray[Any], b: NDArray[Any]) -> NDArray[Any]:
    """Symmetric relative L2 distance between rows (last axis)."""
    import numpy as np

    scale = np.maximum(np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1))
    return np.linalg.norm(a - b, axis=-1) / np.maximum(scale, 1e-12)


def _sample(n: int) -> NDArray[Any]:
    """Which of ``n`` rows form the consensus sample: up to ``CONSENSUS_SAMPLE``, evenly
    spread over the group (in its sorted order)."""
    import numpy as np

    return np.unique(np.linspace(0, n - 1, min(n, CONSENSUS_SAMPLE)).round().astype(int))


def _consensus(sample: NDArray[Any]) -> tuple[NDArray[Any] | None, float]:
    """A strict majority of the ``sample`` rows that agree with each other, averaged;
    else None. Also returns the largest distance seen inside the agreeing set."""
    import numpy as np

    if len(sample) < 2:
        return None, 0.0
    d = _distance(sample[:, None, :], sample[None, :, :])
    agree = d < TOLERANCE
    best = int(agree.sum(axis=1).argmax())
    members = agree[best]
    if members.sum() * 2 <= len(sample):
        return None, 0.0
    spread = float(d[np.ix_(members, members)].max())
    return sample[members].mean(axis=0), spread


def check(
    store: Store, positions: NDArray[Any], total: int, tick: Tick | None = None
) -> PrefixResult:
    """Compare the shared-prefix rows of every group of files. ``positions[index]``: a
    stored file's number in the result (-1: left out); ``tick(n)``: progress."""
    import numpy as np

    result = PrefixResult()
    taking = 0
    for cols in store.values():
        rows = np.flatnonzero(positions[cols.index[: cols.n]] >= 0)
        taking += len(rows)
        if len(rows) < 2:
            if tick:
                tick(len(rows))
            continue
        # Sorted by token ids (-1 pads a short prefix, so it sorts before its extensions,
        # as tuples do); a neighbour's common prefix, capped by both lengths.
        # Ties (the same first token ids) in the files' input order, whatever order the
        # workers returned them in: the consensus sample is the same every run.
        tok = cols.tokens[rows]
        keys = (cols.index[rows], *(tok[:, c] for c in range(PREFIX_ROWS - 1, -1, -1)))
        order = rows[np.lexsort(keys)]
        del tok, keys  # (each copy of the ids is 64-128 bytes a file: one at a time)
        tok = cols.tokens[order]
        length = cols.length[order].astype(np.int64)
        # uint8 counts (at most PREFIX_ROWS): int64 ones were another 128 bytes a file.
        same = np.cumprod(tok[1:] == tok[:-1], axis=1, dtype=np.uint8).sum(axis=1)
        del tok
        lcp = np.minimum(same, np.minimum(length[1:], length[:-1]))
        where = positions[cols.index[order]]
        checked = np.zeros(len(order), dtype=bool)
        # A group is a set of files: the same files at several depths are one group.
        groups: set[tuple[int, int]] = set()
        lost: set[tuple[int, int]] = set()  # groups with a position of no consensus
        for depth in range(1, PREFIX_ROWS + 1):
            if not len(lcp) or lcp.max(initial=0) < depth:
                break
            breaks = np.flatnonzero(lcp < depth)
            starts = np.concatenate(([0], breaks + 1))
            ends = np.concatenate((breaks + 1, [len(order)]))
            for s, e in zip(starts, ends, strict=True):
                if e - s < 2:
                    continue
                checked[s:e] = True
                groups.add((int(s), int(e)))
                if not _check_group(result, cols, order[s:e], where[s:e], depth - 1):
                    lost.add((int(s), int(e)))
        result.checked += int(checked.sum())
        result.groups += len(groups)
        result.no_consensus_groups += len(lost)
        if tick:
            tick(len(rows))
    if tick and total > taking:
        tick(total - taking)  # files with nothing to compare
    return result


# Files of one group compared at a time: bounds what a group of 10^6 files (every file
# shares the chat template's first token) holds in memory to a few megabytes.
GROUP_CHUNK = 2048


def _check_group(
    result: PrefixResult,
    cols: Columns,
    sel: NDArray[Any],
    where: NDArray[Any],
    position: int,
) -> bool:
    """One group at one position (files ``sel`` of ``cols``, ``where`` their numbers):
    per aux slot a consensus of a sample of sound rows, then every sound row against it.
    Whether every slot had a consensus."""
    import numpy as np

    sound = cols.sound[sel, position]  # [files, n_aux]
    size = len(sel)
    refs: list[NDArray[Any] | None] = []
    live: list[int] = []  # the aux layers with at least two sound rows
    for aux in range(cols.n_aux):
        ok = np.flatnonzero(sound[:, aux])
        if len(ok) < 2:
            refs.append(None)
            continue
        live.append(aux)
        ref, spread = _consensus(cols.rows(sel[ok[_sample(len(ok))]], position)[:, aux])
        refs.append(ref)
        if ref is not None:
            result.max_agreeing_distance = max(result.max_agreeing_distance, spread)
    agreed = not any(refs[a] is None for a in live)
    compare = [a for a in live if refs[a] is not None]
    for c0 in range(0, size if live else 0, GROUP_CHUNK):
        c1 = min(c0 + GROUP_CHUNK, size)
        rows = cols.rows(sel[c0:c1], position) if compare else None
        for aux in live:  # per file, the first aux layer that disagrees is reported
            ok = sound[c0:c1, aux]
            ref = refs[aux]
            if ref is None:  # no consensus: none of them can be trusted
                for k in np.flatnonzero(ok):
                    _flag(result, int(where[c0 + k]), position, aux, None, size)
                continue
            assert rows is not None
            dist = _distance(rows[:, aux], ref[None, :])
            for k in np.flatnonzero(ok & (dist >= TOLERANCE)):
                _flag(result, int(where[c0 + k]), position, aux, float(dist[k]), size)
    return agreed


def _flag(
    result: PrefixResult, index: int, position: int, aux: int, dist: float | None, size: int
) -> None:
    if index not in result.findings:  # the first disagreeing position is the one reported
        result.findings[index] = PrefixFinding(index, position, aux, dist, size)


def describe(f: PrefixFinding) -> str:
    if f.distance is None:
        return (
            f"row {f.position} (aux slot {f.aux}) disagrees among the {f.group_size} files "
            "that share its prompt prefix, and no majority of them agree: none can be "
            "trusted (a dataset written by a broken vLLM)"
        )
    return (
        f"row {f.position} (aux slot {f.aux}) differs from the consensus of the "
        f"{f.group_size} files that share its first {f.position + 1} token ids "
        f"(relative L2 {f.distance:.2f}, agreeing files differ by < {TOLERANCE}): "
        "hidden states from other memory"
    )
