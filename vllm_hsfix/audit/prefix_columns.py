"""Where the files' prefix sketches wait for the dataset pass: token ids in memory, rows on disk.

The shared-prefix check (:mod:`.prefix`, whose ``Store`` holds one :class:`Columns`
per shape) needs every file's first token ids (to sort and group the files) and, per
group, the sketches of one position. The token ids stay in memory (about 200 bytes a
file); the sketches (about 4 KB a file with 4 aux layers,
16 positions) go to an unnamed temporary file per ``[n_aux, hidden]`` shape as the
files are judged, and are read back through a memory map, a group at a time. So the
driver's memory no longer grows by kilobytes per file: at speculators' 10^6 files the
sketches alone were 4-5 GB of it.

The temporary files live in the system's temporary directory (``TMPDIR``) and are gone
when the audit ends, or when the process does. Where one cannot be created or written
(a full disk), the sketches stay in memory instead, as before: slower to hold, never an
error.
"""

from __future__ import annotations

import contextlib
import mmap
import tempfile
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from numpy.typing import NDArray

_CHUNK = 1024  # records gathered before one write to the spill file
# Rows read back through the map before its pages are handed back (madvise): they stay
# in the page cache, but leave this process's resident set (each row read maps the
# page of its record: a group of 15,000 files mapped 50 MB before this).
_RELEASE_EVERY = 2048


class Columns:
    """The files of one ``[n_aux, hidden]`` shape. In memory, per file: its index in the
    audit, how many prefix token ids it has, the ids (-1 past its end) and which of its
    rows are sound. On disk, one record per file: the sketches as float16 unit vectors
    and their norms (:func:`rows` puts them back together)."""

    def __init__(self, n_aux: int, positions: int, dim: int) -> None:
        import numpy as np

        self.n_aux, self.positions = n_aux, positions
        self.n = 0
        self.record = np.dtype(
            [
                ("units", np.float16, (positions, n_aux, dim)),
                ("norms", np.float32, (positions, n_aux)),
            ]
        )
        self._chunk = np.zeros(_CHUNK, self.record)
        # The chunk's two fields as arrays, made once: a record taken out of the chunk
        # per file, then its fields, cost 10 of the 12 us an append took.
        self._units, self._norms = self._chunk["units"], self._chunk["norms"]
        self._filled = 0
        self._written = 0  # records in the spill file
        self._spill: IO[bytes] | None = None
        self._held: list[Any] = []  # chunks kept in memory when there is no spill file
        with contextlib.suppress(OSError):  # no spill: the records stay in memory
            self._spill = tempfile.TemporaryFile(  # noqa: SIM115 - closed by close()
                prefix="vllm-hsfix-prefix-", buffering=0
            )
        self._map: Any = None
        self._read = 0
        self._alloc(256)

    def _alloc(self, cap: int) -> None:
        import numpy as np

        old = None if self.n == 0 else self.__dict__.copy()
        self.index = np.zeros(cap, dtype=np.int64)  # the file's index in the audit
        self.length = np.zeros(cap, dtype=np.uint8)  # its number of prefix token ids
        self.tokens = np.full((cap, self.positions), -1, dtype=np.int64)  # -1: past its end
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
        self.index[r], self.length[r] = index, k
        self.tokens[r, :k] = token_ids
        self.sound[r, :k] = sound
        self._units[self._filled, :k] = units
        self._norms[self._filled, :k] = norms
        self._filled += 1
        self.n += 1
        if self._filled == _CHUNK:
            self._flush()

    def _flush(self) -> None:
        """Write the gathered records out (or keep them, where there is no spill)."""
        import numpy as np

        part = self._chunk[: self._filled]
        if self._spill is not None:
            try:
                data = memoryview(part.view(np.uint8))  # no copy
                while data:  # an unbuffered write may take part of it
                    data = data[self._spill.write(data) or 0 :]
                self._written += len(part)
            except OSError:  # a full disk: what was written comes back, the rest stays
                try:
                    self._spill.seek(0)
                    self._held = [np.fromfile(self._spill, self.record, self._written)]
                finally:
                    self._spill.close()
                    self._spill = None
        if self._spill is None:
            self._held.append(part.copy())
        # No clearing: a record's positions past its file's prefix are never read (a
        # group at position p holds only files with more than p token ids).
        self._filled = 0

    def rows(self, sel: NDArray[Any], position: int) -> NDArray[Any]:
        """The sketches of files ``sel`` (row numbers here) at ``position``: float32
        ``[len(sel), n_aux, dim]``."""
        import numpy as np

        if self._map is None:
            self._open()
        # Only this position's numbers: the position first (a strided view of the map),
        # then the files; indexing both at once copied the files' whole records (16
        # positions each) first, 50 MB for a group of 16k files.
        units = self._map["units"][:, position][sel].astype(np.float32)
        out = units * self._map["norms"][:, position][sel][:, :, None]
        self._read += len(sel)
        if self._read >= _RELEASE_EVERY:
            self.release()
        return out

    def _open(self) -> None:
        import numpy as np

        if self._filled:
            self._flush()
        if self._spill is None:
            held = self._held or [np.zeros(0, self.record)]
            self._map = np.concatenate(held) if len(held) > 1 else held[0]
            self._held = [self._map]
        elif self.n:
            self._spill.flush()
            self._map = np.memmap(self._spill, dtype=self.record, mode="r", shape=(self.n,))
        else:
            self._map = np.zeros(0, self.record)

    def release(self) -> None:
        """Hand the map's pages back (they stay in the page cache for the next read)."""
        self._read = 0
        mm = getattr(self._map, "_mmap", None)
        if isinstance(mm, mmap.mmap) and hasattr(mm, "madvise"):
            mm.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        self._map = None
        self._held = []
        if self._spill is not None:
            self._spill.close()
            self._spill = None
