"""Running the child programs of ``support/children`` by path, in a fresh interpreter
(``conftest.run_py``: a session of its own, killed whole afterwards)."""

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


def marked_json(proc: subprocess.CompletedProcess[str], marker: str) -> Any:
    """The JSON a child printed after ``marker`` on a line of its own (``marker`` ends
    with a space); fails with the child's output if there is none."""
    line = next((x for x in proc.stdout.splitlines() if x.startswith(marker)), None)
    assert line is not None, (proc.returncode, proc.stdout[-3000:], proc.stderr[-6000:])
    return json.loads(line[len(marker) :])
