"""Every process logs its own vllm-hsfix line when its patches are decided, before its next
output, in the import orders of vLLM's worker and API processes."""

from __future__ import annotations

import re

import pytest
from conftest import INSTALL, clean_env
from support.procs import child

pytestmark = pytest.mark.needs_vllm

LINE = re.compile(r"\[vllm-hsfix\] vllm-hsfix \S+ pid=(\d+) role=(\S+) vllm=")
# What a GPU worker imports, and what a CPU worker imports instead of the GPU runner.
RUNNER = (
    "vllm.v1.worker.cpu_model_runner" if INSTALL.cpu_build else "vllm.v1.worker.gpu_model_runner"
)


def run_child(*args: str, **env: str) -> list[str]:
    """``support/children/startup.py ARGS`` unbuffered, in one pipe; its output lines."""
    out = child("startup.py", *args, env=clean_env(PYTHONUNBUFFERED="1", **env), merge=True)
    assert out.returncode == 0, out.stdout[-3000:]
    return out.stdout.splitlines()


def hsfix_lines(lines: list[str]) -> list[tuple[int, str]]:
    return [(i, line) for i, line in enumerate(lines) if LINE.search(line)]


def index_of(lines: list[str], marker: str) -> int:
    found = [i for i, line in enumerate(lines) if line.strip() == marker]
    assert found, f"{marker} not printed:\n" + "\n".join(lines[-30:])
    return found[0]


def worker_line_and_status() -> tuple[str, str]:
    """A worker's import order (plugins, model, connector, runner); the line comes first."""
    lines = run_child("worker", RUNNER)
    found = hsfix_lines(lines)
    assert len(found) == 1, "\n".join(lines[-40:])
    at, line = found[0]
    assert at < index_of(lines, "PLUGINS-LOADED"), "\n".join(lines[-40:])
    assert int(LINE.search(line).group(1)) > 0  # type: ignore[union-attr]
    return line, next(line for line in lines if line.startswith("STATUS"))


@pytest.mark.applies("scatter-clamp")
def test_worker_line_arms_at_start_and_applies_on_import() -> None:
    line, status = worker_line_and_status()
    assert "on import scatter-clamp" in line, line
    assert "('scatter-clamp', 'applied')" in status, status


@pytest.mark.fixed_upstream("scatter-clamp")
def test_worker_line_says_the_fix_is_upstream() -> None:
    line, status = worker_line_and_status()
    assert "upstream-fix-present" in line, line
    assert "('scatter-clamp', 'upstream-fix-present')" in status, status


def test_api_process_logs_at_activation_without_importing_any_target() -> None:
    """The API process imports no target: its line still comes at start."""
    lines = run_child("api")
    found = hsfix_lines(lines)
    assert len(found) == 1, "\n".join(lines[-40:])
    assert found[0][0] < index_of(lines, "VLLM-IMPORTED")
    assert "TARGETS []" in lines


def test_forked_and_spawned_children_log_their_own_line() -> None:
    """A forked and a spawned child each log their own line with their own pid."""
    lines = run_child("fork_and_spawn")
    pids = {int(LINE.search(line).group(1)) for _, line in hsfix_lines(lines)}  # type: ignore[union-attr]
    parent = int(next(line.split()[1] for line in lines if line.startswith("PARENT")))
    children = [int(line.split()[1]) for line in lines if line.startswith("CHILD")]
    assert len(children) == 2, "\n".join(lines[-40:])
    assert pids == {parent, *children}, "\n".join(lines[-40:])
    for pid in children:
        line_at = min(i for i, line in hsfix_lines(lines) if f"pid={pid} " in line)
        assert line_at < index_of(lines, f"CHILD {pid}")


@pytest.mark.applies("scatter-clamp")
def test_a_refused_patch_makes_the_line_a_warning() -> None:
    """An unknown version refuses every patch that needs the code: the line is a WARNING."""
    lines = run_child("api", VLLM_HSFIX_VLLM_VERSION="not-a-version")
    found = hsfix_lines(lines)
    assert len(found) == 1 and found[0][1].startswith("WARNING"), "\n".join(lines[-40:])
    assert found[0][0] < index_of(lines, "VLLM-IMPORTED")
