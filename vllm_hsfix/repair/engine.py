"""The repair's vLLM process: ``python -m vllm_hsfix.repair.engine JOB.json``.

A process of its own, so that ``VLLM_HSFIX_STATUS_DIR`` is set before vllm-hsfix activates
and the guard runs where vLLM runs. It drives vLLM's offline ``LLM`` (or a running ``vllm
serve``: ``--endpoint``) and reports in JSON Lines on stdout (``repair --help``). vLLM
0.24.0's ``LLM.generate`` waits forever for a killed engine core: :class:`EngineWatch`
names it in an ``ERROR`` line of the log (the root cause :mod:`.enginelog` reports) and
ends the run when vLLM has not.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

from .files import writer_done

WAIT_S = 300.0
# Exceptions of vLLM's argument and config checks: a user's value among them is named.
REJECTED = ("ValueError", "TypeError", "ValidationError", "AssertionError")
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


def written(paths: list[str | None], step: Callable[[], object]) -> list[str | None]:
    """Each file once its writer is done (``step`` between looks; the connector finishes
    a write in a later engine step); None for no file, or none after ``WAIT_S``."""
    deadline = time.monotonic() + WAIT_S
    while any(p and not writer_done(p) for p in paths) and time.monotonic() < deadline:
        step()
    return [p if p and writer_done(p) else None for p in paths]


class LocalEngine:
    def __init__(self, kwargs: dict[str, Any]) -> None:
        from vllm import LLM, SamplingParams

        self.llm = LLM(**kwargs)
        self.params = SamplingParams(max_tokens=1, temperature=0.0)

    def generate(self, prompts: Sequence[list[int]]) -> list[str | None]:
        """The file each prompt's states went to (None: no file), once written."""
        outs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], self.params, use_tqdm=False
        )
        paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outs]
        one = [{"prompt_token_ids": [1, 2, 3]}]
        return written(paths, lambda: self.llm.generate(one, self.params, use_tqdm=False))


class EndpointEngine:
    def __init__(self, url: str, model: str | None) -> None:
        self.url = url.rstrip("/")
        self.model = model
        if model is None:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=30) as r:
                self.model = json.load(r)["data"][0]["id"]

    def _one(self, ids: list[int]) -> str | None:
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
        headers = {"Content-Type": "application/json"}
        req = urllib.request.Request(
            self.url + "/v1/completions", json.dumps(body).encode(), headers
        )
        with urllib.request.urlopen(req, timeout=WAIT_S) as r:
            path = (json.load(r).get("kv_transfer_params") or {}).get("hidden_states_path")
        return written([path], lambda: time.sleep(0.05))[0]

    def generate(self, prompts: Sequence[list[int]]) -> list[str | None]:
        # Many requests in flight: the server batches them as it would any clients'.
        with ThreadPoolExecutor(max_workers=min(64, max(1, len(prompts)))) as pool:
            return list(pool.map(self._one, prompts))


def unknown_args(user: dict[str, object]) -> list[tuple[str, str]]:
    """The user's engine arguments that vLLM's ``LLM`` / ``EngineArgs`` do not take."""
    import dataclasses
    import difflib
    import inspect

    import vllm
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    known |= set(inspect.signature(vllm.LLM.__init__).parameters) - {"self", "kwargs"}
    out = []
    for key in (k for k in user if k not in known):
        near = difflib.get_close_matches(key, sorted(known), n=3)
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        out.append((key, f"vLLM {vllm.__version__} has no engine argument {key!r}{hint}"))
    return out


def rejected(exc: BaseException, user: dict[str, object]) -> tuple[str, str] | None:
    """(key, vLLM's message) when ``exc`` is vLLM rejecting one of the user's values."""
    import re

    if not any(t in type(exc).__name__ for t in REJECTED):
        return None
    for key in user:
        if re.search(rf"\b{re.escape(key)}\b", str(exc)):
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            return key, f"{type(exc).__name__}: " + " / ".join(lines[:4])
    return None


def channel() -> Callable[..., None]:
    """``send(event=..., ...)`` on this process's stdout; fd 1 then points at stderr,
    so that nothing vLLM prints can fall between two messages."""
    out: IO[str] = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)

    def send(**msg: Any) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    return send


def start(job: dict[str, Any], send: Callable[..., None]) -> LocalEngine | EndpointEngine | int:
    """The engine, its guard passed; else the exit code."""
    from .guard import in_engine

    if job["endpoint"]:
        engine: LocalEngine | EndpointEngine = EndpointEngine(job["endpoint"], job["served"])
        send(event="guard", problems=[])
        return engine
    user = job["user_args"]
    bad = unknown_args(user)
    for key, why in bad:
        send(event="bad_arg", key=key, why=why)
    if bad:
        return 2
    try:
        engine = LocalEngine(job["kwargs"])
    except Exception as exc:
        if found := rejected(exc, user):
            send(event="bad_arg", key=found[0], why=found[1])
        raise
    problems = in_engine(os.environ["VLLM_HSFIX_STATUS_DIR"], job["needed"])
    send(event="guard", problems=problems)
    return 3 if problems else engine


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9: how a process's negative exit status reads."""
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


def _log(message: str) -> None:
    """An ``ERROR`` line in vLLM's log format (stderr is the log)."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"ERROR {stamp} [vllm-hsfix repair] {message}", file=sys.stderr, flush=True)


class EngineWatch:
    """Once started: a thread that names an engine core that died in the log at once,
    and ends this process (:data:`EXIT_ENGINE_GONE`) if vLLM has not ``grace_s`` later.
    A worker's death vLLM reports itself (its executor watches its workers)."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.watched: list[multiprocessing.process.BaseProcess] = []
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        self.told = False

    def start(self) -> None:
        """Watch this process's ``multiprocessing`` children now (vLLM's engine cores,
        named as in vLLM's log: ``EngineCore``, ``EngineCore_DP1``)."""
        self.watched = multiprocessing.active_children()
        if self.watched:
            threading.Thread(target=self._run, name="vllm-hsfix-engine-watch", daemon=True).start()

    def tell(self) -> bool:
        """Name a watched process that is gone in the log (once); whether one is. Also
        called when vLLM raised (its ``EngineDeadError`` only says "see above")."""
        with self.lock:
            for p in self.watched:
                if not self.told and (code := p.exitcode) is not None:
                    _log(cause(p.name, p.pid or 0, code))
                    self.told = True
            return self.told

    def _run(self) -> None:
        while not self.stopped.wait(POLL_S):
            if self.tell():
                if not self.stopped.wait(self.grace_s):
                    _log(f"vLLM did not end the run in {self.grace_s:g} s: vllm-hsfix ends it")
                    os._exit(EXIT_ENGINE_GONE)
                return


def main(argv: list[str]) -> int:
    with open(argv[0], encoding="utf-8") as f:
        job = json.load(f)
    os.setpgrp()  # a group of its own: the repair ends every vLLM process with it at once
    send, parent = channel(), os.getppid()
    engine = start(job, send)
    if isinstance(engine, int):
        return engine
    watch = EngineWatch()  # an engine core killed under us must not leave us waiting
    watch.start()
    try:
        prompts, size = job["prompts"], job["batch_size"]
        for first in range(0, len(prompts), size):
            if os.getppid() != parent:
                return 4  # the repair was killed: stop, leave nothing running
            for k, path in enumerate(engine.generate(prompts[first : first + size])):
                send(event="file", index=first + k, path=path)
    except BaseException:
        watch.tell()  # vLLM raised because one of its processes died: which, and how
        raise
    finally:
        watch.stopped.set()  # vLLM's own shutdown follows: its processes may go now
    send(event="done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
