"""The files the command line writes, and what it says when it cannot. A path is taken
only when it is absent, empty or the CLI's own (by its first line); a whole document is
written through a temporary file beside it, fsync and rename. A path that cannot be read
or written, or holds the user's own file, is one line on stderr and exit 2 (exit 1 is
"corrupt files found"); a reader that closes the pipe early ends the run quietly."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import sys
from collections.abc import Callable, Iterable

STATE_KIND = "vllm-hsfix audit state"
# The exit code of a process killed by SIGPIPE, as ``yes | head`` gives: neither a
# verdict (0, 1) nor a usage error (2).
CLOSED_PIPE = 141


class NotOurs(Exception):
    """An output path that holds a file the CLI did not write: left as it is."""


def json_first(line: bytes) -> dict[str, object] | None:
    """The JSON object on ``line``, else None."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def is_state(line: bytes) -> bool:
    """An ``audit --state`` file's header (any version's)."""
    record = json_first(line)
    return record is not None and record.get("kind") == STATE_KIND


def is_records(line: bytes) -> bool:
    """An ``audit --jsonl`` stream's first record."""
    record = json_first(line)
    return record is not None and record.get("type") in ("file", "update", "summary")


def is_journal(line: bytes) -> bool:
    """A ``repair --state`` journal's first record."""
    record = json_first(line)
    return record is not None and {"path", "status", "sha256"} <= record.keys()


def is_list(line: bytes) -> bool:
    """An ``audit --list`` file's first path."""
    return line.rstrip(b"\r\n").endswith(b".safetensors")


def claim(path: str, option: str, ours: Callable[[bytes], bool], what: str) -> bool:
    """Check, before any work, that ``path`` may be written: raise :class:`NotOurs` when
    it holds something else, ``OSError`` when it cannot be written there. Whether it
    exists (empty or ours)."""
    try:
        with open(path, "rb") as f:
            line = f.readline(4096)
    except FileNotFoundError:
        line = None
    if line and not ours(line):
        raise NotOurs(
            f"{option} {path}: exists and is not {what} (it begins {line[:40]!r}); left as "
            "it is: move it away or name another path"
        )
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        code = errno.ENOTDIR if os.path.exists(directory) else errno.ENOENT
        raise OSError(code, os.strerror(code), path)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
    return line is not None


def write_lines(path: str, lines: Iterable[str]) -> None:
    """Replace ``path`` with ``lines`` (each ends in a newline already, or is joined by
    the caller) through a temporary file, fsync and rename: never a half-written file,
    nothing left behind when it fails."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            for line in lines:
                f.write(line)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def problem(exc: BaseException) -> str:
    """One line for what stopped the run."""
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"cannot use {exc.filename}: {exc.strerror or exc}"
    return str(exc)


def run_guarded(fn: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``fn(args)``, with a path that cannot be used (or is not ours) one line and exit
    2, and a closed stdout an end without a traceback."""
    try:
        return int(fn(args))
    except BrokenPipeError:
        # Nothing more reaches the reader; stdout's own flush at exit must not fail.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return CLOSED_PIPE
    except (NotOurs, OSError) as exc:
        print(f"vllm-hsfix {args.cmd}: {problem(exc)}", file=sys.stderr)
        return 2
