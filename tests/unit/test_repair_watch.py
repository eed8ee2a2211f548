"""A vLLM process dying under ``vllm-hsfix repair``, with stand-in processes: the watch,
the JSON channel's reader, the root cause named."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import clean_env
from support.load import busy_cores
from support.procs import CHILDREN, gone, marked_json, run_child

from vllm_hsfix.repair import engine, enginelog, files, session


def test_a_killed_engine_core_ends_a_process_that_would_wait_forever(tmp_path: Path) -> None:
    """A SIGKILLed engine core under a process that would wait forever: the watch logs an
    ``ERROR`` line naming it and its signal within its grace and exits 5; a helper that ends on
    its own raises no alarm."""
    t0 = time.monotonic()
    with busy_cores():
        proc = run_child("engine_watch.py", {"grace_s": 1.0}, tmp_path, clean_env(), 60)
    took = time.monotonic() - t0
    watched, core, worker = marked_json(proc, "HSFIX_WATCH ")
    assert proc.returncode == engine.EXIT_ENGINE_GONE, proc.stderr[-3000:]
    assert took < 30, f"the watch took {took:.0f} s"
    assert watched == [core] and worker != core
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR ")]
    assert len(lines) == 2, proc.stderr[-3000:]
    assert f"vLLM's process EngineCore (pid {core}) died (killed by SIGKILL: " in lines[0]
    assert "vLLM did not end the run in 1 s" in lines[1]
    cause = enginelog.root_cause(proc.stderr)
    assert cause is not None and f"(pid {core}) died (killed by SIGKILL" in cause.error


def test_the_vllm_process_is_read_line_by_line_and_its_death_mid_line_is_survived() -> None:
    """The reader acts on a dying process's two whole lines, ignores the cut third, and ends
    once the process is gone, killing what it left (every core busy)."""
    args = argparse.Namespace(paths=["x"], endpoint=None, backup=None, no_progress=True)
    follow = session.Follow(args, [], files.Journal("/nonexistent"), files.Fates())
    with busy_cores():
        cmd = [sys.executable, CHILDREN / "dying_vllm.py"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        t0 = time.monotonic()
        assert follow.run(proc) == -signal.SIGKILL and 2 < time.monotonic() - t0 < 30
    [(key, grandchild)] = follow.bad_args
    deadline = time.monotonic() + 5  # SIGKILLed: it may take a moment to exit, under load
    while not gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert key == "k" and gone(grandchild)
    assert follow.bar is not None and follow.ready > t0
    assert session.message('{"event": "fi') == {} and session.message("[1]") == {}
    refused = session.Follow(args, [], files.Journal("/nonexistent"), files.Fates())
    assert not refused.on({"event": "guard", "problems": ["p"]}) and refused.refused == ["p"]


def test_a_signal_that_killed_the_vllm_process_is_the_root_cause(tmp_path: Path) -> None:
    """The signal that killed the front end is the root cause, not the core's ``cancelled``."""
    log = tmp_path / "s.vllm.log"
    log.write_text(
        "(EngineCore pid=7) Traceback (most recent call last):\n"
        '(EngineCore pid=7)   File "core.py", line 1, in run\n'
        "(EngineCore pid=7) RuntimeError: cancelled\n"
    )
    line = session.failure(-9, str(log))
    assert line.startswith("the vLLM run failed: its process was killed by SIGKILL (the OOM")
    assert "cancelled" not in line and line.endswith(f"full log: {log}")
    assert session.failure(1, str(log)).startswith("the vLLM run failed (exit 1); root cause,")


def test_an_engine_dead_error_that_points_above_is_not_the_root_cause() -> None:
    """An "engine core died, see above" with no traceback above is not the cause, the watch's
    line is; a real traceback of a model process still comes first."""
    dead = (
        "Traceback (most recent call last):\n"
        '  File "llm.py", line 1, in generate\n'
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. "
        "See stack trace (above) for the root cause.\n"
    )
    ours = engine.cause("EngineCore", 42, -signal.SIGKILL)
    text = f"INFO 12-03 10:00:00 [llm.py:1] starting\nERROR 12-03 10:00:05 [x] {ours}\n{dead}"
    cause = enginelog.root_cause(text)
    assert cause is not None and cause.process == "the main process"
    assert cause.error == ours
    assert "EngineDeadError" in str(enginelog.root_cause(dead))  # nothing else: still named
    worker = "(Worker pid=9) Traceback (most recent call last):\n(Worker pid=9) ValueError: bad\n"
    found = enginelog.root_cause(worker + text)
    assert found is not None and found.error == "ValueError: bad"
