"""The release as ``python -m build`` makes it: the wheel holds the package, its data and
the ``.pth`` hook and nothing else; the sdist rebuilds it; both pass ``twine check
--strict``; the version is the CHANGELOG's newest."""

from __future__ import annotations

import re
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT, run
from support.commands import build_release, cli

from vllm_hsfix.patches import PATCHES

for tool in ("setuptools", "build", "twine"):  # the vLLM venvs' lock pins all three
    pytest.importorskip(tool, reason=f"building the release needs {tool}")
# What names harness code: the demo and its tiny models, CPU stand-ins, tests.
HARNESS = ("demo", "standin", "tiny_model", "_case.py", "user_script", "conftest")


def harness(name: str) -> bool:
    parts = name.lower().split("/")
    return any(w in name.lower() for w in HARNESS) or any(
        p in ("tests", "test") or p.startswith("test_") for p in parts
    )


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_release(tmp_path_factory.mktemp("release"))


def test_the_wheel_holds_what_users_run_and_no_harness_code(dist: dict[str, Path]) -> None:
    files = zipfile.ZipFile(dist["wheel"]).namelist()
    code = [n for n in files if not n.split("/", 1)[0].endswith(".dist-info")]
    assert [n for n in code if harness(n)] == []
    assert {n.split("/", 1)[0] for n in code} == {
        "vllm_hsfix", "_vllm_hsfix_dist.py", "_vllm_hsfix_plugin.py", "vllm_hsfix_dist.pth",
    }  # fmt: skip
    for name in ("_vllm_hsfix_plugin.py", "vllm_hsfix/tested.json", "vllm_hsfix/cli.py",
                 "vllm_hsfix/_bootstrap/sitecustomize.py", "vllm_hsfix/audit/command.py",
                 "vllm_hsfix/repair/command.py", "vllm_hsfix_dist.pth"):  # fmt: skip
        assert name in files
    assert {p.impl.replace(".", "/") + ".py" for p in PATCHES} <= set(files)


def test_the_sdist_carries_what_a_rebuild_needs_and_no_tests(dist: dict[str, Path]) -> None:
    with tarfile.open(dist["sdist"]) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    for needed in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "CHANGELOG.md",
                   "LICENSE", "vllm_hsfix_dist.pth", "_vllm_hsfix_dist.py", "_vllm_hsfix_plugin.py",
                   "vllm_hsfix/tested.json", "vllm_hsfix/_bootstrap/sitecustomize.py"):  # fmt: skip
        assert needed in names, sorted(names)
    assert [n for n in names if harness(n)] == []


def test_the_metadata_checks_and_names_the_changelogs_release(dist: dict[str, Path]) -> None:
    twine = run([sys.executable, "-m", "twine", "check", "--strict", *dist.values()])
    assert twine.returncode == 0, twine.stdout + twine.stderr
    with zipfile.ZipFile(dist["wheel"]) as zf:
        meta = next(zf.read(n).decode() for n in zf.namelist() if n.endswith("METADATA"))
    version = re.search(r"^Version: (\S+)$", meta, re.M)
    changelog = (ROOT / "CHANGELOG.md").read_text()
    released = re.search(r"^## \[(\d[^\]]*)\] - \d{4}-\d\d-\d\d$", changelog, re.M)
    assert version and released and version[1] == released[1]
    assert cli("--version").stdout.strip() == f"vllm-hsfix {released[1]}"
    assert "Description-Content-Type: text/markdown" in meta
    # The description opens with what an installed user can run (the README's opening,
    # scripts/demo.py, is in neither the wheel nor the sdist).
    first = meta.split("\n\n", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    assert "scripts/" not in first and "vllm-hsfix status" in first, first
    requires = [ln for ln in meta.splitlines() if ln.startswith("Requires-Dist:")]
    # Nothing that could move an image's pin, in any extra.
    assert not [r for r in requires if any(p in r.lower() for p in ("vllm", "torch"))], requires
