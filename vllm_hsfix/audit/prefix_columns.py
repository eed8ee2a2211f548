"""Where the files' prefix sketches wait for the dataset pass: token ids in memory, rows on disk.

The shared-prefix check (:mod:`.prefix`, one :class:`Columns` per ``[n_aux, hidden]``
shape) needs every file's first token ids (to sort and group the files) and, per
group, the sketches of one position. The ids stay in memory; the sketches (kilobytes a
file) go to an unnamed temporary file in ``TMPDIR`` as the files are judged, written a
chunk of files at a time, position by position within the chunk, and are read back
with ``pread`` a group at a time (one position of a group is then a block of each
chunk). Reads, not a memory map, which would bring large page-cache folios into the
resident set. Where no temporary file can be made or written (a full disk) the
sketches stay in memory: slower to hold, never an error.
"""

from __future__ import annotations

import contextlib
import tempfile
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from numpy.typing import NDArray

_CHUNK = 1024  # files gathered before one write to the spill file
# A chunk's block at one position is read whole when at least 1/_DENSE of its files
# are wanted (one read of 200-300 KB instead of that many small ones).
_DENSE = 16
_I32_MIN, _I32_END = -(2**31), 2**31


class Columns:
    """The files of one ``[n_aux, hidden]`` shape. In memory, per file: its index in the
    audit, how many prefix token ids it has, the ids (-1 past its end) and which of its
    rows are sound. On disk, per chunk of files and position, each file's sketches as
    float16 unit vectors and their norms (:func:`rows` puts them back together)."""

    def __init__(self, n_aux: int, positions: int, dim: int) -> None:
        import numpy as np

        self.n_aux, self.positions = n_aux, positions
        self.n = 0
        self.cell = np.dtype([("units", np.float16, (n_aux, dim)), ("norms", np.float32, n_aux)])
        self._chunk = np.zeros((positions, _CHUNK), self.cell)  # one chunk, position-major
        # The chunk's two fields as arrays, made once (taking them per file cost 10 of
        # the 12 us an append took).
        self._units, self._norms = self._chunk["units"], self._chunk["norms"]
        self._filled = 0
        self._written = 0  # chunks in the spill file
        self._spill: IO[bytes] | None = None
        self._held: list[Any] = []  # chunks kept in memory when there is no spill file
        with contextlib.suppress(OSError):  # no spill: the records stay in memory
            self._spill = tempfile.TemporaryFile(  # noqa: SIM115 - closed by close()
                prefix="vllm-hsfix-prefix-", buffering=0
            )
        self._memory: Any = None  # the chunks, stacked, where there is no spill file
        self._ready = False
        self._alloc(256)

    def _alloc(self, cap: int) -> None:
        import numpy as np

        old = None if self.n == 0 else self.__dict__.copy()
        self.index = np.zeros(cap, dtype=np.int64)  # the file's index in the audit
        self.length = np.zeros(cap, dtype=np.uint8)  # its number of prefix token ids
        # -1: past its end. int32 holds every vocabulary's ids (half the memory of int64);
        # a file whose ids do not fit widens the column (:meth:`append`).
        dtype = np.int64 if old is not None and old["tokens"].itemsize == 8 else np.int32
        self.tokens = np.full((cap, self.positions), -1, dtype=dtype)
        self.sound = np.zeros((cap, self.positions, self.n_aux), dtype=bool)
        if old is not None:
            for name in ("index", "length", "tokens", "sound"):
                getattr(self, name)[: self.n] = old[name][: self.n]

    def append(
        self,
        index: int,
        token_ids: tuple[int, ...],
        units: NDArray[Any],
        norms: NDArray[Any],
        sound: NDArray[Any],
    ) -> None:
        """File ``index``'s first ``k`` token ids and, per position ``< k``, its sketches
        as unit vectors ``[k, n_aux, dim]``, their ``norms`` and ``sound`` ``[k, n_aux]``."""
        if self.n == len(self.index):
            self._alloc(self.n + self.n // 2)
        r, k = self.n, len(token_ids)
        narrow = self.tokens.itemsize == 4  # once widened, no file's ids need a look
        if narrow and k and not _I32_MIN <= min(token_ids) <= max(token_ids) < _I32_END:
            self.tokens = self.tokens.astype("int64")  # not a vocabulary's ids: kept as is
        self.index[r], self.length[r] = index, k
        self.tokens[r, :k] = token_ids
        self.sound[r, :k] = sound
        self._units[:k, self._filled] = units
        self._norms[:k, self._filled] = norms
        self._filled += 1
        self.n += 1
        if self._filled == _CHUNK:
            self._flush()

    def _flush(self) -> None:
        """Write the chunk out, whole (or keep it, where there is no spill)."""
        import numpy as np

        if self._spill is not None:
            try:
                data = memoryview(self._chunk.view(np.uint8).reshape(-1))  # no copy
                while data:  # an unbuffered write may take part of it
                    data = data[self._spill.write(data) or 0 :]
                self._written += 1
            except OSError:  # a full disk: what was written comes back, the rest stays
                try:
                    self._spill.seek(0)
                    count = self._written * self.positions * _CHUNK
                    old = np.fromfile(self._spill, self.cell, count)
                    self._held = list(old.reshape(-1, self.positions, _CHUNK))
                finally:
                    self._spill.close()
                    self._spill = None
        if self._spill is None:
            self._held.append(self._chunk.copy())
        # No clearing: a file's positions past its prefix are never read (a group at
        # position p holds only files with more than p token ids).
        self._filled = 0

    def rows(self, sel: NDArray[Any], position: int) -> NDArray[Any]:
        """The sketches of files ``sel`` (row numbers here) at ``position``: float32
        ``[len(sel), n_aux, dim]``."""
        import numpy as np

        if self._filled or not self._ready:
            self._finish()
        chunk, at = np.divmod(np.asarray(sel, dtype=np.int64), _CHUNK)
        if self._spill is None:
            cells = self._memory[chunk, position, at]
        else:
            cells = self._read_cells(chunk, at, position)
        return cells["units"].astype(np.float32) * cells["norms"][:, :, None]

    def _read_cells(self, chunk: NDArray[Any], at: NDArray[Any], position: int) -> Any:
        """Files ``at`` of chunks ``chunk`` at ``position``, read with ``pread``: per
        chunk, this position's whole block where many of its files are wanted, else
        each file's cell. Reads, not a memory map: a mapped page cache brings whole
        large folios into the resident set."""
        import os

        import numpy as np

        out = np.empty(len(chunk), self.cell)
        size = self.cell.itemsize
        block = _CHUNK * size
        fd = self._spill.fileno()  # type: ignore[union-attr]
        order = np.argsort(chunk, kind="stable")
        bounds = np.flatnonzero(np.diff(chunk[order])) + 1
        for run in np.split(order, bounds):
            c = int(chunk[run[0]])
            base = (c * self.positions + position) * block
            if len(run) * _DENSE >= _CHUNK:
                data = np.frombuffer(os.pread(fd, block, base), self.cell)
                out[run] = data[at[run]]
            else:
                for k in run.tolist():
                    raw = os.pread(fd, size, base + int(at[k]) * size)
                    out[k] = np.frombuffer(raw, self.cell)[0]
        return out

    def _finish(self) -> None:
        """The last chunk written out (or kept): what is stored is complete."""
        import numpy as np

        if self._filled:
            self._flush()
        if self._spill is None:
            held = self._held or [np.zeros((self.positions, _CHUNK), self.cell)]
            self._memory = np.stack(held)
            self._held = list(self._memory)  # chunk by chunk, as appended
        else:
            self._spill.flush()
        self._ready = True

    def close(self) -> None:
        self._memory = None
        self._held = []
        if self._spill is not None:
            self._spill.close()
            self._spill = None
