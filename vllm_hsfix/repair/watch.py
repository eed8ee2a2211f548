"""No vLLM engine core that dies leaves the repair's vLLM process waiting.

vLLM 0.24.0's ``LLM.generate`` waits forever for a killed engine core: :class:`EngineWatch`
names it in an ``ERROR`` line of the log (the root cause :mod:`..enginelog` reports) and
ends the run when vLLM has not. A worker that dies takes its engine core with it (vLLM's
executor watches its workers).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time

GRACE_S = 10.0  # how long vLLM gets to raise once one of its processes is gone
POLL_S = 0.5
EXIT_ENGINE_GONE = 5
# What most likely sent the signals a vLLM process dies of without a traceback.
SENDERS = {
    "SIGKILL": "the OOM killer or a user (`dmesg` names OOM kills)",
    "SIGILL": "a native kernel using an instruction this CPU lacks",
    "SIGSEGV": "a crash in native code",
    "SIGBUS": "a crash in native code, or a file mapped in memory that shrank",
    "SIGABRT": "a native library aborted",
}


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def cause(name: str, pid: int, exitcode: int) -> str:
    """The line that names a vLLM process gone, how it ended and what most likely did it."""
    how = f"exit status {exitcode}"
    if exitcode < 0:
        sig = signal_name(-exitcode)
        how = f"killed by {sig}" + (f": {SENDERS[sig]}" if sig in SENDERS else "")
    return f"vLLM's process {name} (pid {pid}) died ({how})"


def title(pid: int) -> str:
    """The process's title as ``ps`` shows it (vLLM's ``VLLM::EngineCore``), its first word."""
    import psutil

    try:
        return " ".join(psutil.Process(pid).cmdline()).split(" ")[0] or "?"
    except psutil.Error:
        return "?"


def _log(message: str) -> None:
    """An ``ERROR`` line in vLLM's log format (stderr is the log)."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"ERROR {stamp} [vllm-hsfix repair] {message}", file=sys.stderr, flush=True)


class EngineWatch:
    """Once started: a thread that names an engine core that died in the log at once,
    and ends this process (:data:`EXIT_ENGINE_GONE`) if vLLM has not ``grace_s`` later."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.watched: list[tuple[multiprocessing.process.BaseProcess, str]] = []
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        self.told = False

    def start(self) -> None:
        """Watch this process's ``multiprocessing`` children now (vLLM's engine cores)."""
        self.watched = [(p, title(p.pid or 0)) for p in multiprocessing.active_children()]
        if self.watched:
            threading.Thread(target=self._run, name="vllm-hsfix-engine-watch", daemon=True).start()

    def tell(self) -> bool:
        """Name a watched process that is gone in the log (once); whether one is. Also
        called when vLLM raised (its ``EngineDeadError`` only says "see above")."""
        with self.lock:
            for p, name in self.watched:
                if not self.told and (code := p.exitcode) is not None:
                    _log(cause(name, p.pid or 0, code))
                    self.told = True
            return self.told

    def _run(self) -> None:
        while not self.stopped.wait(POLL_S):
            if self.tell():
                if not self.stopped.wait(self.grace_s):
                    _log(f"vLLM did not end the run in {self.grace_s:g} s: vllm-hsfix ends it")
                    os._exit(EXIT_ENGINE_GONE)
                return
