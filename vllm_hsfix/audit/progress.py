"""Progress of each pass (``scan``, ``norms``, ``prefix``, ``reference``): tqdm's bar on
a terminal; in a log, where ``\\r`` frames would pile up into one line, a plain line
every ``interval`` seconds and one at the end."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import IO, Any

DEFAULT_INTERVAL = 10.0
# ``factory(label, total, total_bytes=0)`` -> a pass's progress: ``update(n, nbytes)``,
# ``close()``.
Factory = Callable[..., Any]


class LogLines:
    """A line every ``interval`` seconds (and one at the end) for logs: no ``\\r``;
    with no ``stream``, nothing (``--no-progress``, library calls)."""

    def __init__(
        self,
        label: str,
        total: int,
        stream: IO[str] | None,
        interval: float = DEFAULT_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label, self.total, self.stream, self.interval = label, total, stream, interval
        self.clock = clock
        self.done = self.nbytes = 0
        self.t0 = self.last = clock()

    def update(self, n: int = 1, nbytes: int = 0) -> None:
        self.done += n
        self.nbytes += nbytes
        now = self.clock()
        if now - self.last >= self.interval and self.done < self.total:
            self.last = now
            self._write(now)

    def _write(self, now: float) -> None:
        if self.stream is None:
            return
        s = now - self.t0
        rate = max(s, 1e-9)
        amount = f", {self.nbytes / 1e9:.2f} GB" if self.nbytes else ""
        speed = f", {self.nbytes / 1e9 / rate:.3f} GB/s" if self.nbytes else ""
        self.stream.write(
            f"audit {self.label}: {self.done}/{self.total} files{amount}, {s:.1f} s, "
            f"{self.done / rate:.1f} files/s{speed}\n"
        )
        self.stream.flush()

    def close(self) -> None:
        self._write(self.clock())
        self.stream = None  # once


def SILENT(label: str, total: int, total_bytes: int = 0) -> Any:
    """The factory that draws nothing (``--no-progress``, library calls)."""
    return LogLines(label, total, None, math.inf)


def for_stream(stream: IO[str] | None = None, interval: float = DEFAULT_INTERVAL) -> Factory:
    """The factory fitting ``stream`` (stderr by default): tqdm on a terminal, else log
    lines."""
    out = stream if stream is not None else sys.stderr
    if not getattr(out, "isatty", lambda: False)():
        return lambda label, total, total_bytes=0: LogLines(label, total, out, interval)

    def bar(label: str, total: int, total_bytes: int = 0) -> Any:
        from tqdm import tqdm

        # ``update(n, nbytes)``: tqdm's own update takes the files; the bytes are dropped.
        made = tqdm(total=total, desc=f"audit {label}", unit="file", file=out, leave=True)
        files_only = made.update
        made.update = lambda n=1, nbytes=0: files_only(n)
        return made

    return bar
