"""A machine whose cores are all busy, for the tests of what a starved process does
(a worker killed while the others spin: its retry, its death noticed, a bound hit)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

# Spins until stopped, or until its parent is gone (a test runner killed by a timeout
# must not leave cores spinning): the parent is checked every few milliseconds.
SPIN = Path(__file__).resolve().parent / "children" / "spin.py"


def cores() -> int:
    """The cores this process may run on (its affinity, else the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@contextlib.contextmanager
def busy_cores(n: int | None = None) -> Iterator[list[int]]:
    """``n`` processes (default: one per core) spinning a core for the block, all started
    before it; yields their pids and kills and reaps them when it ends."""
    count = cores() if n is None else n
    procs: list[subprocess.Popen[str]] = []
    try:
        for _ in range(count):
            procs.append(
                subprocess.Popen([sys.executable, SPIN], stdout=subprocess.PIPE, text=True)
            )
        for p in procs:  # each one's first line: it is spinning now
            assert p.stdout is not None and p.stdout.readline() == "spinning\n"
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
