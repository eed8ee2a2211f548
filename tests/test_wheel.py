"""The wheel holds what users run: the package, its data and the ``.pth`` hook, and no
demo, harness, stand-in or test code. Built from a copy of this checkout's files (what
git tracks or would add: no stale ``build/``) with the environment's own setuptools (no
download), listed from the archive itself."""

from __future__ import annotations

import os
import sys
import zipfile

import pytest
from conftest import run
from support.commands import checkout_copy

from vllm_hsfix.patches import PATCHES

pytest.importorskip("setuptools", reason="building the wheel needs setuptools (the vLLM venvs)")
# What names harness code: the demo and its tiny models, CPU stand-ins, tests.
HARNESS = ("demo", "standin", "tiny_model", "_case.py", "user_script", "conftest")


def harness(name: str) -> bool:
    parts = name.lower().split("/")
    return any(w in name.lower() for w in HARNESS) or any(
        p in ("tests", "test") or p.startswith("test_") for p in parts
    )


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    out, src = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("src")
    checkout_copy(src, "-co", "--exclude-standard")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    proc = run([*cmd, "-q", "-w", out, src], dict(os.environ), cwd=out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (whl,) = out.glob("vllm_hsfix-*.whl")
    return zipfile.ZipFile(whl).namelist()


def test_the_wheel_holds_no_harness_code(wheel_files: list[str]) -> None:
    code = [n for n in wheel_files if not n.split("/", 1)[0].endswith(".dist-info")]
    assert [n for n in code if harness(n)] == []
    assert {n.split("/", 1)[0] for n in code} == {
        "vllm_hsfix", "_vllm_hsfix_dist.py", "_vllm_hsfix_plugin.py", "vllm_hsfix_dist.pth",
    }  # fmt: skip


def test_the_wheel_holds_what_users_run(wheel_files: list[str]) -> None:
    for name in ("_vllm_hsfix_plugin.py", "vllm_hsfix/tested.json", "vllm_hsfix/cli.py",
                 "vllm_hsfix/_bootstrap/sitecustomize.py", "vllm_hsfix/audit/command.py",
                 "vllm_hsfix/repair/command.py", "vllm_hsfix_dist.pth"):  # fmt: skip
        assert name in wheel_files
    assert {p.impl.replace(".", "/") + ".py" for p in PATCHES} <= set(wheel_files)
