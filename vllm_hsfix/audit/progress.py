"""Progress of each audit pass, drawn to fit where it runs.

On a terminal, tqdm draws the bar (vLLM itself requires tqdm, so every vLLM image has
it; without it the log form below is used). Anywhere else (a job log, a CI console, a
file) a bar is noise: ``\\r`` frames pile up into one enormous line. There, one plain
line every ``interval`` seconds and one when the pass ends, each with the rate:

    audit scan: 1200/5000 files, 3.41 GB, 12.0 s, 100.0 files/s, 0.284 GB/s

Every pass has one: ``scan`` (files and bytes), ``prefix`` and ``norms`` (files),
``reference`` (files recomputed). :class:`Progress` is the one interface the pipeline
sees; :data:`SILENT` draws nothing (``--no-progress``, library calls).
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any, Protocol

DEFAULT_INTERVAL = 10.0


class Progress(Protocol):
    """One pass's progress: ``update`` as work is done, ``close`` at the end."""

    def update(self, n: int = 1, nbytes: int = 0) -> None: ...

    def close(self) -> None: ...


class Factory(Protocol):
    """Makes the :class:`Progress` of one pass (``label``: scan, prefix, norms, ...)."""

    def __call__(self, label: str, total: int, total_bytes: int = 0) -> Progress: ...


def rate_line(
    label: str,
    done: int,
    total: int,
    nbytes: int,
    seconds: float,
    second: str = "bytes",
    prefix: str = "audit ",
) -> str:
    """``audit scan: 12/20 files, 0.10 GB, 1.0 s, 12.0 files/s, 0.100 GB/s``; with
    ``second="tokens"`` the second count is tokens (``repair``: tokens/s); ``prefix``
    names the command (``repair`` passes its own label and none)."""
    s = max(seconds, 1e-9)
    line = f"{prefix}{label}: {done}/{total} files"
    if nbytes and second == "tokens":
        line += f", {nbytes} tokens"
    elif nbytes:
        line += f", {nbytes / 1e9:.2f} GB"
    line += f", {seconds:.1f} s, {done / s:.1f} files/s"
    if nbytes and second == "tokens":
        line += f", {nbytes / s:.0f} tokens/s"
    elif nbytes:
        line += f", {nbytes / 1e9 / s:.3f} GB/s"
    return line


class _Silent:
    def update(self, n: int = 1, nbytes: int = 0) -> None:
        pass

    def close(self) -> None:
        pass


def silent(label: str, total: int, total_bytes: int = 0) -> Progress:
    """The factory that draws nothing."""
    return _Silent()


SILENT: Factory = silent


class LogLines:
    """A line every ``interval`` seconds (and at the end) for logs: no ``\\r``."""

    def __init__(
        self,
        label: str,
        total: int,
        stream: IO[str],
        interval: float,
        clock: Any = time.monotonic,
        second: str = "bytes",
        prefix: str = "audit ",
    ) -> None:
        self.label, self.total, self.stream = label, total, stream
        self.second, self.prefix = second, prefix
        self.interval, self.clock = interval, clock
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
        line = rate_line(
            self.label, self.done, self.total, self.nbytes, now - self.t0, self.second, self.prefix
        )
        self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._write(self.clock())


class TqdmBar:
    """tqdm's bar on a terminal, with GB/s beside files/s when bytes are known."""

    def __init__(
        self,
        label: str,
        total: int,
        total_bytes: int,
        stream: IO[str],
        second: str = "bytes",
        prefix: str = "audit ",
    ) -> None:
        from tqdm import tqdm

        desc = f"{prefix}{label}"
        self.bar = tqdm(total=total, desc=desc, unit="file", file=stream, leave=True)
        self.total_bytes = total_bytes
        self.second = second
        self.nbytes = 0
        self.t0 = time.monotonic()

    def update(self, n: int = 1, nbytes: int = 0) -> None:
        self.nbytes += nbytes
        if self.total_bytes:
            rate = self.nbytes / max(time.monotonic() - self.t0, 1e-9)
            text = f"{rate:.0f} tokens/s" if self.second == "tokens" else f"{rate / 1e9:.3f} GB/s"
            self.bar.set_postfix_str(text, refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def for_stream(
    stream: IO[str] | None = None,
    interval: float = DEFAULT_INTERVAL,
    second: str = "bytes",
    prefix: str = "audit ",
) -> Factory:
    """The factory fitting ``stream`` (stderr by default): tqdm on a terminal when it
    is installed, else log lines every ``interval`` seconds. ``second``: what the
    second count is, ``bytes`` (audit) or ``tokens`` (repair); ``prefix``: put before
    each pass's label (the command's name)."""
    out = stream if stream is not None else sys.stderr
    tty = bool(getattr(out, "isatty", lambda: False)())
    use_tqdm = False
    if tty:
        try:
            import tqdm  # noqa: F401

            use_tqdm = True
        except ImportError:
            pass

    def make(label: str, total: int, total_bytes: int = 0) -> Progress:
        if use_tqdm:
            return TqdmBar(label, total, total_bytes, out, second, prefix)
        return LogLines(label, total, out, interval, second=second, prefix=prefix)

    return make
