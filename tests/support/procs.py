"""Running the child programs of ``support/children`` by path, in a fresh interpreter
(``conftest.run_py``: a session of its own, killed whole afterwards), and what is left
of a run that leads its own session."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from conftest import run_py

CHILDREN = Path(__file__).resolve().parent / "children"
TESTS = CHILDREN.parent.parent


def run_child(
    script: str, args: dict[str, Any], work: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run ``support/children/<script>`` as ``__main__`` with ``args`` (written to
    ``work/args.json``, its one argument), ``tests/`` on its ``sys.path``."""
    (work / "args.json").write_text(json.dumps(args))
    argv = [str(CHILDREN / script), str(work / "args.json")]
    code = (
        f"import runpy, sys\nsys.argv = {argv!r}\nsys.path.insert(0, {str(TESTS)!r})\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    return run_py(code, env=env, timeout=timeout)


def marked(text: str, marker: str) -> Any:
    """The JSON printed after ``marker`` (ending with a space) on a line of its own in
    ``text``, or None when no line carries it."""
    line = next((x for x in text.splitlines() if x.startswith(marker)), None)
    return None if line is None else json.loads(line[len(marker) :])


def marked_json(proc: subprocess.CompletedProcess[str], marker: str) -> Any:
    """``marked`` in a child's stdout; fails with the child's output if there is none."""
    got = marked(proc.stdout, marker)
    assert got is not None, (proc.returncode, proc.stdout[-3000:], proc.stderr[-6000:])
    return got


def alive_in_session(sid: int) -> list[int]:
    """Processes still in session ``sid`` (a run started with ``start_new_session``
    leads its own): what outlived it."""
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
