"""Why a vLLM run failed, read from its log: the first traceback of a model process
(lines prefixed ``(EngineCore_DP0 pid=123)``), not the front end's last line. Pure text.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

# "(EngineCore_DP0 pid=123) " then vLLM's header "ERROR 12-01 23:40:01 [core.py:1000] ",
# each optional (the date form varies).
LINE = re.compile(
    r"^(?:\((?P<name>[\w.-]+) pid=(?P<pid>\d+)\) )?"
    r"(?:(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) [\d-]+ [\d:.]+ \[[^\]]*\] )?(?P<text>.*)"
)
# multiprocessing's own line before a dead child's traceback: "Process EngineCore_DP0:"
PROCESS_LINE = re.compile(r"^Process (?P<name>[\w.-]+):$")
TRACEBACK = "Traceback (most recent call last):"
# The line that ends a traceback: "ValueError: ...", "torch.OutOfMemoryError: ...",
# "KeyboardInterrupt", "pydantic_core._pydantic_core.ValidationError: 1 validation ..."
EXCEPTION = re.compile(
    r"^(?:[A-Za-z_][\w]*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Warning)\b"
)
CHAINED = ("The above exception", "During handling")
MODEL_PROCESSES = ("EngineCore", "Worker", "VllmWorker")
# A front end's exception that says the cause is elsewhere in the log: a consequence.
POINTERS = ("See stack trace (above) for the root cause", "See root cause above")
MORE_LINES = 4  # continuation lines of a multi-line message kept (pydantic's, vLLM's)
MAIN = "the main process"
Line = tuple[str | None, str | None, str]  # (process or None for the main one, level, text)


@dataclass(frozen=True)
class Cause:
    process: str  # "EngineCore_DP0 (pid 123)", "Worker (pid 456)", "the main process"
    error: str  # the exception line, with the message's continuation lines

    def __str__(self) -> str:
        return f"{self.error} [in {self.process}]"


def _parse(text: str) -> list[Line]:
    """Each line's process, level and text without its prefixes."""
    out: list[Line] = []
    for raw in text.splitlines():
        m = LINE.match(raw)
        assert m is not None  # every part is optional
        proc = f"{m['name']} (pid {m['pid']})" if m["name"] else None
        out.append((proc, m["level"], m["text"].rstrip()))
    return out


def _tracebacks(lines: list[Line]) -> Iterator[Cause]:
    """Every traceback's final exception line (with its continuation lines), in log order."""
    i = 0
    while i < len(lines):
        proc, _, text = lines[i]
        i += 1
        if text.strip() != TRACEBACK:
            continue
        ends = (j for j in range(i, len(lines)) if lines[j][0] == proc and _raised(lines[j][2]))
        j = next(ends, None)
        if j is None:
            return
        named = None
        if proc is None and i > 1 and lines[i - 2][0] is None:  # "Process EngineCore_DP0:"
            named = PROCESS_LINE.match(lines[i - 2][2].strip())
        message = [lines[j][2]]
        for p, _, t in lines[j + 1 : j + 1 + MORE_LINES]:
            if p != proc or t.strip() in ("", TRACEBACK) or t.startswith(CHAINED):
                break
            if EXCEPTION.match(t):
                break
            message.append(t.strip())
        yield Cause(proc or (named["name"] if named else MAIN), "\n".join(message))
        i = j + 1


def _raised(text: str) -> bool:
    """The line names an exception (not a traceback's indented source line)."""
    return bool(text) and not text[0].isspace() and EXCEPTION.match(text) is not None


def root_cause(text: str) -> Cause | None:
    """The first exception of a model process, else the first traceback's, else the
    first ``ERROR`` line, else one that only points elsewhere (``POINTERS``)."""
    lines = _parse(text)
    found = list(_tracebacks(lines))
    model = [c for c in found if c.process.startswith(MODEL_PROCESSES)]
    own = [c for c in found if not any(p in c.error for p in POINTERS)]
    errors = [Cause(p or MAIN, t) for p, lv, t in lines if lv in ("ERROR", "CRITICAL") and t]
    return next(iter(model + own + errors + found), None)


def read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


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
