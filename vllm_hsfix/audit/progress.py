"""Progress of each pass (audit's ``scan``, ``norms``, ``prefix``, ``reference``; repair's
own): tqdm's bar on a terminal; in a log, where ``\\r`` frames would pile up into one
line, a plain line every ``interval`` seconds and one at the end."""

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


def _amount(n: int, second: str, seconds: float | None = None) -> str:
    """``, 0.10 GB`` or with ``seconds`` the rate ``, 0.100 GB/s`` (tokens for repair)."""
    if not n:
        return ""
    if second == "tokens":
        return f", {n} tokens" if seconds is None else f", {n / seconds:.0f} tokens/s"
    return f", {n / 1e9:.2f} GB" if seconds is None else f", {n / 1e9 / seconds:.3f} GB/s"


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
        second: str = "bytes",
        prefix: str = "audit ",
    ) -> None:
        self.label, self.total, self.stream, self.interval = prefix + label, total, stream, interval
        self.clock, self.second = clock, second
        self.done = self.nbytes = 0
        self.t0 = self._last = clock()

    def update(self, n: int = 1, nbytes: int = 0) -> None:
        self.done += n
        self.nbytes += nbytes
        now = self.clock()
        if now - self._last >= self.interval and self.done < self.total:
            self._last = now
            self._write(now)

    def _write(self, now: float) -> None:
        if self.stream is None:
            return
        s = now - self.t0
        rate = max(s, 1e-9)
        self.stream.write(
            f"{self.label}: {self.done}/{self.total} files{_amount(self.nbytes, self.second)}"
            f", {s:.1f} s, {self.done / rate:.1f} files/s"
            f"{_amount(self.nbytes, self.second, rate)}\n"
        )
        self.stream.flush()

    def close(self) -> None:
        self._write(self.clock())
        self.stream = None  # once


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


def SILENT(label: str, total: int, total_bytes: int = 0) -> Any:
    """The factory that draws nothing (``--no-progress``, library calls)."""
    return LogLines(label, total, None, math.inf)


def for_stream(
    stream: IO[str] | None = None,
    interval: float = DEFAULT_INTERVAL,
    second: str = "bytes",
    prefix: str = "audit ",
) -> Factory:
    """The factory fitting ``stream`` (stderr by default): tqdm on a terminal, else log
    lines. ``second``: ``bytes`` (audit) or ``tokens`` (repair)."""
    out = stream if stream is not None else sys.stderr
    use_tqdm = bool(getattr(out, "isatty", lambda: False)())

    def make(label: str, total: int, total_bytes: int = 0) -> Any:
        if use_tqdm:
            return _Bar(prefix + label, total, total_bytes, out, second)
        return LogLines(label, total, out, interval, second=second, prefix=prefix)

    return make
