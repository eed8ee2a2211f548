"""Progress of each pass (``scan``, ``norms``, ``prefix``, ``reference``; repair's own).

On a terminal tqdm draws the bar. In a log (a job, a CI console, a file) ``\\r`` frames
would pile up into one enormous line, so there it is one plain line every ``interval``
seconds and one at the end, with the rates::

    audit scan: 1200/5000 files, 3.41 GB, 12.0 s, 100.0 files/s, 0.284 GB/s
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO, Any, Protocol

DEFAULT_INTERVAL = 10.0


class Progress(Protocol):
    """One pass's progress: ``update`` as work is done, ``close`` at the end."""

    def update(self, n: int = 1, nbytes: int = 0) -> None: ...

    def close(self) -> None: ...


class Factory(Protocol):
    """Makes the :class:`Progress` of one pass (``label``: scan, prefix, norms, ...)."""

    def __call__(self, label: str, total: int, total_bytes: int = 0) -> Progress: ...


def _amount(nbytes: int, second: str, seconds: float | None = None) -> str:
    """``, 0.10 GB``, or with ``seconds`` the rate ``, 0.100 GB/s`` (``second="tokens"``:
    ``, N tokens``, ``, N tokens/s``); empty when nothing is counted."""
    if not nbytes:
        return ""
    if second == "tokens":
        return f", {nbytes} tokens" if seconds is None else f", {nbytes / seconds:.0f} tokens/s"
    if seconds is None:
        return f", {nbytes / 1e9:.2f} GB"
    return f", {nbytes / 1e9 / seconds:.3f} GB/s"


class LogLines:
    """A line every ``interval`` seconds (and one at the end) for logs: no ``\\r``."""

    def __init__(
        self,
        label: str,
        total: int,
        stream: IO[str],
        interval: float,
        clock: Callable[[], float] = time.monotonic,
        second: str = "bytes",
        prefix: str = "audit ",
    ) -> None:
        self.label, self.total, self.stream, self.interval = prefix + label, total, stream, interval
        self.clock, self.second = clock, second
        self.done = self.nbytes = 0
        self.t0 = self._last = clock()
        self._closed = False

    def update(self, n: int = 1, nbytes: int = 0) -> None:
        self.done += n
        self.nbytes += nbytes
        now = self.clock()
        if now - self._last >= self.interval and self.done < self.total:
            self._last = now
            self._write(now)

    def _write(self, now: float) -> None:
        s = now - self.t0
        rate = max(s, 1e-9)
        self.stream.write(
            f"{self.label}: {self.done}/{self.total} files{_amount(self.nbytes, self.second)}"
            f", {s:.1f} s, {self.done / rate:.1f} files/s"
            f"{_amount(self.nbytes, self.second, rate)}\n"
        )
        self.stream.flush()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._write(self.clock())


class _Bar:
    """tqdm's bar, with GB/s (or tokens/s) beside files/s when the amount is known."""

    def __init__(self, label: str, total: int, total_bytes: int, out: IO[str], second: str):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=label, unit="file", file=out, leave=True)
        self.total_bytes, self.second, self.nbytes = total_bytes, second, 0

    def update(self, n: int = 1, nbytes: int = 0) -> None:
        self.nbytes += nbytes
        if self.total_bytes:
            took = max(self.bar.format_dict["elapsed"], 1e-9)
            self.bar.set_postfix_str(_amount(self.nbytes, self.second, took)[2:], refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


class _Silent:
    def update(self, n: int = 1, nbytes: int = 0) -> None:
        pass

    def close(self) -> None:
        pass


def silent(label: str, total: int, total_bytes: int = 0) -> Progress:
    """The factory that draws nothing (``--no-progress``, library calls)."""
    return _Silent()


SILENT: Factory = silent


def for_stream(
    stream: IO[str] | None = None,
    interval: float = DEFAULT_INTERVAL,
    second: str = "bytes",
    prefix: str = "audit ",
) -> Factory:
    """The factory fitting ``stream`` (stderr by default): tqdm on a terminal where it is
    installed, else log lines every ``interval`` seconds. ``second``: ``bytes`` (audit)
    or ``tokens`` (repair); ``prefix``: put before each pass's label."""
    out = stream if stream is not None else sys.stderr
    use_tqdm = bool(getattr(out, "isatty", lambda: False)())
    if use_tqdm:
        try:
            import tqdm  # noqa: F401
        except ImportError:
            use_tqdm = False

    def make(label: str, total: int, total_bytes: int = 0) -> Any:
        if use_tqdm:
            return _Bar(prefix + label, total, total_bytes, out, second)
        return LogLines(label, total, out, interval, second=second, prefix=prefix)

    return make
