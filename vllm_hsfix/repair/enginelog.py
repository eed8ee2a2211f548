"""Why a vLLM run failed, read from its log: the first traceback of a model process
(lines prefixed ``(EngineCore_DP0 pid=123)``), not the front end's last line. Pure text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# "(EngineCore_DP0 pid=123) " / "(Worker pid=456) " / "(Worker_TP0 pid=7) "
PREFIX = re.compile(r"^\((?P<name>[\w.-]+) pid=(?P<pid>\d+)\) ")
# vLLM's log header: "ERROR 12-01 23:40:01 [core.py:1000] " (the date form varies).
HEADER = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) [\d-]+ [\d:.]+ \[[^\]]*\] ")
# multiprocessing's own line before a dead child's traceback: "Process EngineCore_DP0:"
PROCESS_LINE = re.compile(r"^Process (?P<name>[\w.-]+):$")
TRACEBACK = "Traceback (most recent call last):"
# The line that ends a traceback: "ValueError: ...", "torch.OutOfMemoryError: ...",
# "KeyboardInterrupt", "pydantic_core._pydantic_core.ValidationError: 1 validation ..."
EXCEPTION = re.compile(
    r"^(?:[A-Za-z_][\w]*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Warning)\b"
)
MODEL_PROCESSES = ("EngineCore", "Worker", "VllmWorker")
# A front end's exception that says the cause is elsewhere in the log: a consequence.
POINTERS = ("See stack trace (above) for the root cause", "See root cause above")
MORE_LINES = 4  # continuation lines of a multi-line message kept (pydantic's, vLLM's)


@dataclass(frozen=True)
class Cause:
    process: str  # "EngineCore_DP0 (pid 123)", "Worker (pid 456)", "the main process"
    error: str  # the exception line, with the message's continuation lines

    def __str__(self) -> str:
        return f"{self.error} [in {self.process}]"


def _split(line: str) -> tuple[str | None, str]:
    """(process of the line or None for the main process, the text without prefixes)."""
    proc = None
    m = PREFIX.match(line)
    if m:
        proc = f"{m['name']} (pid {m['pid']})"
        line = line[m.end() :]
    h = HEADER.match(line)
    if h:
        line = line[h.end() :]
    return proc, line.rstrip()


def _is_model_process(proc: str | None) -> bool:
    return proc is not None and proc.startswith(MODEL_PROCESSES)


def _tracebacks(lines: list[tuple[str | None, str]]) -> list[Cause]:
    """Every traceback's final exception line, in log order."""
    out = []
    i = 0
    while i < len(lines):
        proc, text = lines[i]
        if text.strip() != TRACEBACK:
            i += 1
            continue
        if proc is None and i > 0:  # "Process EngineCore_DP0:" just before it
            m = PROCESS_LINE.match(lines[i - 1][1].strip())
            if m and lines[i - 1][0] is None:
                proc = m["name"]
        j = i + 1
        while j < len(lines):
            p, t = lines[j]
            if p == lines[i][0] and t and not t[0].isspace() and EXCEPTION.match(t):
                break
            j += 1
        if j == len(lines):
            break
        message = [lines[j][1]]
        for p, t in lines[j + 1 : j + 1 + MORE_LINES]:
            if p != lines[i][0] or not t.strip() or t.strip() == TRACEBACK:
                break
            if t.startswith(("The above exception", "During handling")) or EXCEPTION.match(t):
                break
            message.append(t.strip())
        out.append(Cause(proc or "the main process", "\n".join(message)))
        i = j + 1
    return out


def root_cause(text: str) -> Cause | None:
    """The first exception of a model process, else the first traceback's, else the
    first ``ERROR`` line, else one that only points elsewhere (``POINTERS``)."""
    lines = [_split(ln) for ln in text.splitlines()]
    found = _tracebacks(lines)
    for cause in found:
        if _is_model_process(cause.process):
            return cause
    own = [c for c in found if not any(p in c.error for p in POINTERS)]
    if own:
        return own[0]
    for raw in text.splitlines():
        proc, rest = _split(raw)
        h = HEADER.match(raw[PREFIX.match(raw).end() :] if PREFIX.match(raw) else raw)
        if h and h["level"] in ("ERROR", "CRITICAL") and rest:
            return Cause(proc or "the main process", rest)
    return found[0] if found else None


def read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def one_line(path: str) -> str:
    """The root cause's first line and its process, then where the full log is."""
    cause = root_cause(read(path))
    if cause is None:
        return f"no exception in vLLM's log; full log: {path}"
    return f"{cause.error.splitlines()[0]} [in {cause.process}]; full log: {path}"


def explain(path: str, tail: int = 1500) -> str:
    """Lines for a user: the root cause (or the log's tail when none is found), then
    where the full log is."""
    text = read(path)
    cause = root_cause(text)
    if cause is None:
        body = "no exception in vLLM's log; its last lines:\n" + text[-tail:].rstrip()
    else:
        body = f"root cause, in {cause.process}:\n  " + cause.error.replace("\n", "\n  ")
    return f"{body}\nfull log: {path}"
