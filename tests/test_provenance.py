"""Opt-in provenance: files saved through the real connector module carry our metadata."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import CONNECTOR_MODULE, INSTALL, MODEL_MODULE, clean_env, last_json, run_py

pytestmark = [pytest.mark.needs_vllm, pytest.mark.applies("scatter-clamp")]

WRITE = f"""
import importlib, json, sys, torch
import vllm_hsfix
importlib.import_module({MODEL_MODULE!r})
conn = importlib.import_module({CONNECTOR_MODULE!r})
path = sys.argv[1] if len(sys.argv) > 1 else None
"""


def _write(tmp_path: Path, env: dict[str, str]) -> tuple[dict, str]:
    target = tmp_path / "req-0.safetensors"
    out = run_py(
        WRITE
        + f"""
tensors = {{"hidden_states": torch.randn(5, 3, 16).to(torch.bfloat16),
            "token_ids": torch.arange(5)}}
conn.save_file(tensors, {str(target)!r}, metadata={{"user": "kept"}})
from safetensors import safe_open
with safe_open({str(target)!r}, "pt") as f:
    meta = f.metadata()
wrapped = getattr(conn.save_file, "hsfix_patch", None)
vllm_hsfix.unapply()
print(json.dumps([meta, wrapped, getattr(conn.save_file, "hsfix_patch", None)]))
""",
        env=env,
    )
    meta, wrapped, after = last_json(out.stdout)
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
