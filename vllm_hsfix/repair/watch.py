"""No vLLM process that dies leaves the repair waiting, and none outlives it.

vLLM's ``LLM.generate`` waits forever for a killed engine core (0.24.0): :class:`EngineWatch`,
in the repair's vLLM process, names a vLLM process gone in an ``ERROR`` line of the log
(the root cause :mod:`..enginelog` reports), gives vLLM :data:`GRACE_S` to raise, then
ends the run (:data:`EXIT_ENGINE_GONE`). A killed vLLM process leaves its engine core
holding its stdout: :class:`ChildTree`, in the repair, kills what is left
:data:`EOF_GRACE_S` later. Linux (``/proc``); elsewhere neither watches anything.
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

# How long vLLM gets to raise on its own once one of its processes is gone.
GRACE_S = 10.0
POLL_S = 0.5
EXIT_ENGINE_GONE = 5
# How long the processes a dead vLLM process left may keep its stdout open.
EOF_GRACE_S = 5.0
TREE_POLL_S = 1.0
# multiprocessing's helper processes: not vLLM's, and they end on their own.
HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver")


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of ``pid`` from ``/proc``; None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0].decode(), int(fields[19])


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").strip()
    except OSError:
        return b""


def descendants(root: int) -> dict[int, tuple[int, int]]:
    """Every process below ``root``: pid -> (its parent, its start time)."""
    if not os.path.isdir("/proc"):
        return {}
    kids: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            kids.setdefault(st[0], []).append((int(entry), st[2]))
    out: dict[int, tuple[int, int]] = {}
    todo = [root]
    while todo:
        parent = todo.pop()
        for pid, started in kids.get(parent, []):
            out[pid] = (parent, started)
            todo.append(pid)
    return out


def vllm_processes(root: int) -> dict[int, tuple[int, bytes]]:
    """vLLM's processes below ``root`` (pid -> (start time, command line)): those it
    titled (``VLLM::EngineCore``, ``VLLM::Worker``: ``VLLM_PROCESS_NAME_PREFIX``), else,
    without setproctitle, ``root``'s own children (the engine cores). Never a helper of
    multiprocessing, nor a process a worker starts and ends as it pleases (a compile
    pool): a watched process that ends means the engine is gone."""
    below = descendants(root)
    lines = {pid: _cmdline(pid) for pid in below}
    title = (os.environ.get("VLLM_PROCESS_NAME_PREFIX") or "VLLM").encode() + b"::"
    chosen = [pid for pid in below if lines[pid].startswith(title)]
    if not chosen:
        chosen = [pid for pid, (parent, _) in below.items() if parent == root]
    return {
        pid: (below[pid][1], lines[pid])
        for pid in chosen
        if not any(h in lines[pid] for h in HELPERS)
    }


def exit_status(pid: int, proc: Any = None) -> str:
    """How child ``pid`` ended: from ``proc``, its ``multiprocessing`` object where
    there is one (vLLM's engine cores: vLLM reaps them at once, the object keeps the
    code), else peeked without reaping; "" when it is not our child."""
    if proc is not None and proc.exitcode is not None:
        code = proc.exitcode
    else:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except (OSError, AttributeError):
            return ""
        if info is None:
            return ""
        killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        code = -info.si_status if killed else info.si_status
    return f"exit status {code}" if code >= 0 else f"killed by {signal_name(-code)}"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class EngineWatch:
    """While started: a thread that names a vLLM process that died in the log at once,
    and ends this process when vLLM has not ended it :data:`GRACE_S` seconds later."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.watched: dict[int, tuple[int, bytes]] = {}
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

    def gone(self) -> tuple[int, str] | None:
        """(pid, how it ended) of a watched process that is gone, else None."""
        for pid, (started, _) in self.watched.items():
            st = _stat(pid)
            if st is None or st[1] in ("Z", "X") or st[2] != started:
                return pid, exit_status(pid, self.objects.get(pid))
        return None

    def tell(self) -> bool:
        """Name a watched process that is gone in the log (once); whether one is. Also
        called when vLLM raised (its ``EngineDeadError`` only says "see above")."""
        with self.lock:
            if not self.told and (found := self.gone()) is not None:
                _log(cause(self.watched[found[0]][1], *found))
                self.told = True
            return self.told

    def _run(self) -> None:
        since = None
        while not self.stopped.wait(POLL_S):
            if since is None and self.tell():
                since = time.monotonic()
            if since is not None and time.monotonic() - since >= self.grace_s:
                self._give_up()

    def _give_up(self) -> None:
        """vLLM did not end the run: say so, end its other processes, exit."""
        _log(f"vLLM did not end the run in {self.grace_s:g} s: vllm-hsfix ends it")
        for pid, (started, _) in self.watched.items():
            st = _stat(pid)
            if st is not None and st[2] == started:  # the same process, not a reused pid
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        os._exit(EXIT_ENGINE_GONE)


# What most likely sent the signals a vLLM process dies of without a traceback.
SENDERS = {
    "SIGKILL": "the OOM killer or a user (`dmesg` names OOM kills)",
    "SIGILL": "a native kernel using an instruction this CPU lacks",
    "SIGSEGV": "a crash in native code",
    "SIGBUS": "a crash in native code, or a file mapped in memory that shrank",
    "SIGABRT": "a native library aborted",
}


def cause(cmdline: bytes, pid: int, how: str) -> str:
    """The line that names a vLLM process gone and what most likely ended it."""
    name = cmdline.decode(errors="replace").split(" ")[0] or "?"
    sender = SENDERS.get(how.rsplit(" ", 1)[-1]) if how.startswith("killed") else None
    if sender:
        why = f"{how}: {sender}"
    elif how:
        why = how
    else:  # not our child: no status to read, and no traceback of it in the log
        why = (
            "no traceback of it: a signal, SIGKILL from the OOM killer (`dmesg` names "
            "OOM kills) or a crash in native code"
        )
    return f"vLLM's process {name} (pid {pid}) died ({why})"


def _log(message: str) -> None:
    """An ``ERROR`` line in vLLM's log format (stderr is the log), so that the repair
    reports it as the root cause when no traceback says more."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"ERROR {stamp} [vllm-hsfix repair] {message}", file=sys.stderr, flush=True)


class ChildTree:
    """The processes below the repair's vLLM process ``proc``, listed every
    :data:`TREE_POLL_S` while it runs; ``grace_s`` after it has exited, those still
    there (unless its output was read to the end) are killed, and :meth:`kill` kills
    them at once."""

    def __init__(self, proc: subprocess.Popen[str], grace_s: float = EOF_GRACE_S) -> None:
        self.proc = proc
        self.grace_s = grace_s
        self.known: dict[int, tuple[int, int]] = {}
        self.eof = threading.Event()
        threading.Thread(target=self._run, name="vllm-hsfix-child-tree", daemon=True).start()

    def _run(self) -> None:
        while self.proc.poll() is None:
            self.known = descendants(self.proc.pid) or self.known
            time.sleep(TREE_POLL_S)
        if not self.eof.wait(self.grace_s):
            self.kill()

    def kill(self) -> list[int]:
        """SIGKILL what is left of the run (a pid checked against its start time, never
        a reused one); the pids killed."""
        killed = []
        for pid, (_, started) in list(self.known.items()):
            st = _stat(pid)
            if st is not None and st[1] not in ("Z", "X") and st[2] == started:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
        return killed
