"""Opt-in provenance: files saved through the real connector module carry our metadata."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import INSTALL, clean_env
from support.procs import child_json

pytestmark = [pytest.mark.needs_vllm, pytest.mark.applies("scatter-clamp")]


def _write(tmp_path: Path, env: dict[str, str]) -> tuple[dict, str]:
    target = tmp_path / "req-0.safetensors"
    meta, wrapped, after = child_json("lookups.py", "saved", target, env=env)
    assert after is None  # unapply restored the module's own save_file
    return meta, wrapped


def test_files_carry_provenance_when_asked(tmp_path: Path) -> None:
    meta, wrapped = _write(tmp_path, clean_env(VLLM_HSFIX_PROVENANCE="1"))
    assert wrapped == "provenance"
    assert meta["user"] == "kept"
    assert meta["vllm_hsfix.vllm"] == INSTALL.version
    assert "scatter-clamp" in meta["vllm_hsfix.patches"]

    from vllm_hsfix.audit import output, pipeline

    report = pipeline.audit_paths([tmp_path / "req-0.safetensors"], workers=1)
    assert report.files[0].provenance["vllm_hsfix.vllm"] == INSTALL.version
    assert "provenance: 1 of 1 files made with vllm-hsfix" in output.format_human(report)


def test_no_provenance_by_default(tmp_path: Path) -> None:
    meta, wrapped = _write(tmp_path, clean_env())
    assert wrapped is None
    assert not any(k.startswith("vllm_hsfix.") for k in meta)

    from vllm_hsfix.audit import output, pipeline

    report = pipeline.audit_paths([tmp_path / "req-0.safetensors"], workers=1)
    assert "none of 1 files carry vllm-hsfix metadata" in output.format_human(report)
