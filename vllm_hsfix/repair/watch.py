"""No vLLM process that dies leaves the repair's vLLM process waiting.

vLLM 0.24.0's ``LLM.generate`` waits forever for a killed engine core: :class:`EngineWatch`
names the process gone in an ``ERROR`` line of the log (the root cause
:mod:`.enginelog` reports) and ends the run when vLLM has not. Processes are followed
with psutil (a vLLM dependency).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from typing import Any

GRACE_S = 10.0  # how long vLLM gets to raise once one of its processes is gone
POLL_S = 0.5
EXIT_ENGINE_GONE = 5
# multiprocessing's helper processes: not vLLM's, and they end on their own.
HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
# What most likely sent the signals a vLLM process dies of without a traceback.
SENDERS = {
    "SIGKILL": "the OOM killer or a user (`dmesg` names OOM kills)",
    "SIGILL": "a native kernel using an instruction this CPU lacks",
    "SIGSEGV": "a crash in native code",
    "SIGBUS": "a crash in native code, or a file mapped in memory that shrank",
    "SIGABRT": "a native library aborted",
}


def _cmdline(p: Any) -> str:
    try:
        return " ".join(p.cmdline())
    except Exception:  # psutil.Error: gone or not ours to read
        return ""


def _alive(p: Any) -> bool:
    """The same process (never a reused pid), not a zombie."""
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill(procs: list[Any]) -> None:
    """SIGKILL those of ``procs`` still alive."""
    for p in procs:
        with contextlib.suppress(Exception):
            if _alive(p):
                p.kill()


def vllm_processes(root: int) -> list[Any]:
    """vLLM's processes below ``root``: those it titled (``VLLM::EngineCore``,
    ``VLLM::Worker``), else ``root``'s own children; never a multiprocessing helper."""
    import psutil

    top = psutil.Process(root)
    title = (os.environ.get("VLLM_PROCESS_NAME_PREFIX") or "VLLM") + "::"
    chosen = [p for p in top.children(recursive=True) if _cmdline(p).startswith(title)]
    chosen = chosen or top.children()
    return [p for p in chosen if not any(h in _cmdline(p) for h in HELPERS)]


def exit_status(proc: Any) -> str:
    """How a child ended, from its ``multiprocessing`` object (vLLM starts its engine
    cores so, and reaps them at once); "" for another process."""
    code = None if proc is None else proc.exitcode
    if code is None:
        return ""
    return f"exit status {code}" if code >= 0 else f"killed by {signal_name(-code)}"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def cause(cmdline: str, pid: int, how: str) -> str:
    """The line that names a vLLM process gone and what most likely ended it."""
    name = cmdline.split(" ")[0] or "?"
    sender = SENDERS.get(how.rsplit(" ", 1)[-1]) if how.startswith("killed") else None
    if sender:
        how = f"{how}: {sender}"
    elif not how:  # not our child: no status to read, and no traceback of it in the log
        how = (
            "no traceback of it: a signal, SIGKILL from the OOM killer (`dmesg` names "
            "OOM kills) or a crash in native code"
        )
    return f"vLLM's process {name} (pid {pid}) died ({how})"


def _log(message: str) -> None:
    """An ``ERROR`` line in vLLM's log format (stderr is the log)."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"ERROR {stamp} [vllm-hsfix repair] {message}", file=sys.stderr, flush=True)


class EngineWatch:
    """Once started: a thread that names a vLLM process that died in the log at once, and
    ends this process (:data:`EXIT_ENGINE_GONE`) if vLLM has not ``grace_s`` later."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.watched: list[Any] = []
        self.names: dict[int, str] = {}
        self.objects: dict[int, Any] = {}  # pid -> multiprocessing object, set by start()
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        self.told = False

    def start(self) -> None:
        """Watch the vLLM processes below this one now (the engine has started)."""
        self.watched = vllm_processes(os.getpid())
        self.names = {p.pid: _cmdline(p) for p in self.watched}
        self.objects = {p.pid: p for p in multiprocessing.active_children()}
        if self.watched:
            threading.Thread(target=self._run, name="vllm-hsfix-engine-watch", daemon=True).start()

    def tell(self) -> bool:
        """Name a watched process that is gone in the log (once); whether one is. Also
        called when vLLM raised (its ``EngineDeadError`` only says "see above")."""
        with self.lock:
            gone = next((p.pid for p in self.watched if not _alive(p)), None)
            if not self.told and gone is not None:
                how = exit_status(self.objects.get(gone))
                _log(cause(self.names[gone], gone, how))
                self.told = True
            return self.told

    def _run(self) -> None:
        while not self.stopped.wait(POLL_S):
            if self.tell():
                if not self.stopped.wait(self.grace_s):
                    _log(f"vLLM did not end the run in {self.grace_s:g} s: vllm-hsfix ends it")
                    _kill(self.watched)
                    os._exit(EXIT_ENGINE_GONE)
                return
