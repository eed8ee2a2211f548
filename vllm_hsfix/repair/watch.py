"""No vLLM process that dies leaves the repair waiting, and none outlives it.

vLLM's ``LLM.generate`` waits forever for a killed engine core (0.24.0): :class:`EngineWatch`,
in the repair's vLLM process, names a vLLM process gone in an ``ERROR`` line of the log
(the root cause :mod:`..enginelog` reports), gives vLLM :data:`GRACE_S` to raise, then
ends the run (:data:`EXIT_ENGINE_GONE`). A killed vLLM process leaves its engine core
holding its stdout: :class:`ChildTree`, in the repair, kills what is left
:data:`EOF_GRACE_S` later. Processes are read with psutil (a vLLM requirement).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

GRACE_S = 10.0  # how long vLLM gets to raise on its own once one of its processes is gone
POLL_S = 0.5
EXIT_ENGINE_GONE = 5
EOF_GRACE_S = 5.0  # how long what a dead vLLM process left may keep its stdout open
TREE_POLL_S = 1.0
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


def below(root: int) -> list[Any]:
    """The processes below ``root`` (psutil objects; [] when it is gone)."""
    try:
        import psutil

        return list(psutil.Process(root).children(recursive=True))
    except Exception:  # gone, or no psutil (--endpoint without vLLM here: none below)
        return []


def alive(p: Any) -> bool:
    """The same process (not a reused pid), not yet a zombie."""
    import psutil

    try:
        return bool(p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def vllm_processes(root: int) -> dict[int, tuple[Any, str]]:
    """vLLM's processes below ``root`` (pid -> (process, command line)): those it titled
    (``VLLM::EngineCore``, ``VLLM::Worker``), else, without setproctitle, ``root``'s own
    children. Never a helper of multiprocessing, nor a process started and ended at will
    (a compile pool): a watched process that ends means the engine is gone."""
    info = {p.pid: (p, p.as_dict(["ppid", "cmdline"], ad_value=None)) for p in below(root)}
    line = {pid: " ".join(d["cmdline"] or []).strip() for pid, (_, d) in info.items()}
    title = (os.environ.get("VLLM_PROCESS_NAME_PREFIX") or "VLLM") + "::"
    chosen = [pid for pid in info if line[pid].startswith(title)]
    chosen = chosen or [pid for pid, (_, d) in info.items() if d["ppid"] == root]
    return {
        pid: (info[pid][0], line[pid]) for pid in chosen if not any(h in line[pid] for h in HELPERS)
    }


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def exit_status(pid: int, proc: Any = None) -> str:
    """How child ``pid`` ended: from ``proc``, its ``multiprocessing`` object where there
    is one (vLLM reaps its engine cores at once), else peeked without reaping; "" when
    it is not our child."""
    code = proc.exitcode if proc is not None else None
    if code is None:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except (OSError, AttributeError):
            return ""
        if info is None:
            return ""
        killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        code = -info.si_status if killed else info.si_status
    return f"exit status {code}" if code >= 0 else f"killed by {signal_name(-code)}"


def cause(cmdline: str, pid: int, how: str) -> str:
    """The line that names a vLLM process gone and what most likely ended it."""
    name = cmdline.split(" ")[0] or "?"
    sender = SENDERS.get(how.rsplit(" ", 1)[-1]) if how.startswith("killed") else None
    if sender:
        why = f"{how}: {sender}"
    else:  # not our child: no status to read, and no traceback of it in the log
        why = how or (
            "no traceback of it: a signal, SIGKILL from the OOM killer (`dmesg` names "
            "OOM kills) or a crash in native code"
        )
    return f"vLLM's process {name} (pid {pid}) died ({why})"


def _log(message: str) -> None:
    """An ``ERROR`` line in vLLM's log format (stderr is the log)."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"ERROR {stamp} [vllm-hsfix repair] {message}", file=sys.stderr, flush=True)


class EngineWatch:
    """While started: a thread that names a vLLM process that died in the log at once,
    and ends this process when vLLM has not ended it ``grace_s`` seconds later."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.watched: dict[int, tuple[Any, str]] = {}
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        self.told = False
        self.objects: dict[int | None, Any] = {}  # multiprocessing's objects of our children

    def start(self) -> None:
        """Watch the processes below this one now (the engine has started)."""
        self.watched = vllm_processes(os.getpid())
        self.objects = {p.pid: p for p in multiprocessing.active_children()}
        if self.watched:
            threading.Thread(target=self._run, name="vllm-hsfix-engine-watch", daemon=True).start()

    def stop(self) -> None:
        """vLLM's own shutdown follows: its processes may go now."""
        self.stopped.set()

    def tell(self) -> bool:
        """Name a watched process that is gone in the log (once); whether one is. Also
        called when vLLM raised (its ``EngineDeadError`` only says "see above")."""
        with self.lock:
            for pid, (p, line) in self.watched.items():
                if not self.told and not alive(p):
                    _log(cause(line, pid, exit_status(pid, self.objects.get(pid))))
                    self.told = True
            return self.told

    def _run(self) -> None:
        since = None
        while not self.stopped.wait(POLL_S):
            if since is None and self.tell():
                since = time.monotonic()
            if since is not None and time.monotonic() - since >= self.grace_s:
                _log(f"vLLM did not end the run in {self.grace_s:g} s: vllm-hsfix ends it")
                for p, _ in self.watched.values():
                    if alive(p):
                        with contextlib.suppress(Exception):
                            p.kill()
                os._exit(EXIT_ENGINE_GONE)


class ChildTree:
    """The processes below the repair's vLLM process ``proc``, listed every
    :data:`TREE_POLL_S` while it runs; ``grace_s`` after it exited, those left are
    killed unless its output was read to the end (``eof`` set)."""

    def __init__(self, proc: subprocess.Popen[str], grace_s: float = EOF_GRACE_S) -> None:
        self.proc = proc
        self.grace_s = grace_s
        self.known: list[Any] = []
        self.eof = threading.Event()
        threading.Thread(target=self._run, name="vllm-hsfix-child-tree", daemon=True).start()

    def _run(self) -> None:
        while self.proc.poll() is None:
            self.known = below(self.proc.pid) or self.known
            time.sleep(TREE_POLL_S)
        if not self.eof.wait(self.grace_s):
            self.kill()

    def kill(self) -> list[int]:
        """SIGKILL what is left of the run (never a reused pid); the pids killed."""
        killed = []
        for p in self.known:
            if alive(p):
                with contextlib.suppress(Exception):
                    p.kill()
                    killed.append(p.pid)
        return killed
