"""Running the child programs of ``support/children`` by path in a fresh interpreter, and
what is left of a run that leads its own session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import clean_env, last_json, run

CHILDREN = Path(__file__).resolve().parent / "children"
TESTS = CHILDREN.parent.parent


def child(
    script: str,
    *args: Any,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    merge: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``support/children/<script> ARGS`` (default environment ``clean_env()``) with this
    checkout and ``tests/`` first on ``PYTHONPATH``; ``merge``: one pipe for both."""
    return run([sys.executable, CHILDREN / script, *args], on_path(env), timeout, merge=merge)


def on_path(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default ``clean_env()``) with this checkout and ``tests/`` first on the path."""
    env = dict(clean_env() if env is None else env)
    paths = (str(TESTS.parent), str(TESTS), env.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def child_json(script: str, *args: Any, **kw: Any) -> Any:
    """The last JSON line of ``child(script, *args, **kw)``; fails with its stderr unless exit 0."""
    out = child(script, *args, **kw)
    assert out.returncode == 0, (out.returncode, out.stdout[-2000:], out.stderr[-4000:])
    return last_json(out.stdout)


def audit_child(*args: Any, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``support/children/audit_runs.py ARGS`` from the checkout (``env``: default this
    process's), decoded by hand so a ``\r`` in its output survives."""
    env = on_path(dict(os.environ) if env is None else env)
    cmd = [sys.executable, CHILDREN / "audit_runs.py", *map(str, args)]
    got = subprocess.run(cmd, capture_output=True, timeout=300, cwd=TESTS.parent, env=env)
    out, err = got.stdout.decode(), got.stderr.decode()
    return subprocess.CompletedProcess(cmd, got.returncode, out, err)


def run_child(
    script: str, args: dict[str, Any], work: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """``child(script)`` with ``args`` written to ``work/args.json``, its one argument."""
    (work / "args.json").write_text(json.dumps(args))
    return child(script, work / "args.json", env=env, timeout=timeout)


def marked(text: str, marker: str) -> Any:
    """The JSON after ``marker`` (ending with a space) on a line of its own, or None."""
    line = next((x for x in text.splitlines() if x.startswith(marker)), None)
    return None if line is None else json.loads(line[len(marker) :])


def marked_json(proc: subprocess.CompletedProcess[str], marker: str) -> Any:
    """``marked`` in a child's stdout; fails with the child's output if there is none."""
    got = marked(proc.stdout, marker)
    assert got is not None, (proc.returncode, proc.stdout[-3000:], proc.stderr[-6000:])
    return got


def alive_in_session(sid: int) -> list[int]:
    """Processes still in session ``sid``: what outlived a run that led its own session."""
    alive = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            alive.append(int(d.name))
    return alive


def gone(pid: int) -> bool:
    """Process ``pid`` has exited (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")
