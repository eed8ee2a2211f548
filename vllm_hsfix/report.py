"""What this process tells the world: its one log line and status files (``views.live``).
Logs go to the application's handlers, else to ``sys.stderr``."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from . import views
from ._version import __version__
from .codes import APPLIED, FAILED, REFUSED, Code
from .config import Config
from .state import STATE

log = logging.getLogger("vllm_hsfix")


class FallbackStderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at emit time (never a stream closed since),
    and only when the record would reach no other handler."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        if not _other_handlers(self):
            super().emit(record)


def _other_handlers(ours: logging.Handler) -> bool:
    logger: logging.Logger | None = log
    while logger is not None:
        if any(h is not ours for h in logger.handlers):
            return True
        if not logger.propagate:
            return False
        logger = logger.parent  # type: ignore[assignment]
    return False


def setup_logging(cfg: Config) -> None:
    log.setLevel(cfg.log_level)
    if not any(isinstance(h, FallbackStderrHandler) for h in log.handlers):
        handler = FallbackStderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s [vllm-hsfix] %(message)s"))
        log.addHandler(handler)


def summary_line() -> str:
    """The process's one line: the patches applied, armed (patched on import), and
    those skipped, refused or failed, each with its code."""
    inst = STATE.install
    vllm = "absent"
    if inst is not None and inst.present:
        build = ", CPU build" if inst.cpu_build else ""
        found = inst.version or inst.raw_version or "?"
        vllm = f"{found} ({inst.distribution or inst.source}{build})"
    groups: dict[str, list[str]] = {}
    for rec in STATE.records.values():
        if rec.status == APPLIED:
            groups.setdefault(APPLIED, []).append(rec.patch.id)
        elif rec.code == Code.ARMED:
            groups.setdefault("on import", []).append(rec.patch.id)
        else:
            groups.setdefault(rec.status, []).append(f"{rec.patch.id} [{rec.code}]")
    parts = [f"{k} {', '.join(v)}" for k, v in groups.items()]
    line = (
        f"vllm-hsfix {__version__} pid={os.getpid()} role={views.process_role()} vllm={vllm}: "
        + "; ".join(parts)
    )
    if STATE.verify is not None:
        line += f"; in-situ check {'passed' if STATE.verify.get('ok') else 'FAILED'}"
    return line


def log_summary_once(at_exit: bool = False) -> None:
    """Log the process's line once every patch is decided (armed counts), or at exit
    once any is; at WARNING when one was refused or failed."""
    waiting = [r.code == Code.WAITING for r in STATE.records.values()]
    if STATE.logged or (all(waiting) if at_exit else any(waiting)):
        return
    STATE.logged = True
    bad = any(r.status in (REFUSED, FAILED) for r in STATE.records.values())
    log.log(logging.WARNING if bad else logging.INFO, summary_line())


def deviation(rec: Any) -> None:
    """An armed patch met a live module that its gate refused, or failed to apply: the
    line already logged said otherwise, so log it again, at WARNING."""
    if STATE.logged:
        log.warning("%s: %s (%s)", rec.patch.id, rec.code, rec.reason)
        log.warning(summary_line())


def at_exit() -> None:
    """The line for a process that never decided all patches, and the last status file."""
    log_summary_once(at_exit=True)
    write_status_file()


def write_status_file() -> None:
    cfg = STATE.config
    if cfg is None or not cfg.status_dir or STATE.install is None:
        return
    try:
        path = Path(cfg.status_dir)
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / f".{os.getpid()}.json.tmp"
        tmp.write_text(json.dumps(views.live(), indent=2, default=str))
        tmp.replace(path / f"{os.getpid()}.json")
    except Exception as exc:
        log.debug("could not write status file: %r", exc)


def provenance_metadata() -> dict[str, str]:
    """The provenance keys for a hidden-states file written now, in this process."""
    inst = STATE.install
    applied = sorted(r.patch.id for r in STATE.records.values() if r.status == APPLIED)
    check = STATE.verify
    out = {
        "version": __version__,
        "vllm": (inst.version if inst else None) or "unknown",
        "patches": ",".join(applied) or "none",
        "in_situ_check": "not run" if check is None else ("passed" if check["ok"] else "FAILED"),
    }
    if STATE.aux_layers is not None:
        out["aux_layers"] = ",".join(map(str, STATE.aux_layers))
    if STATE.engine:
        out["engine"] = json.dumps(STATE.engine, sort_keys=True)
    return out
