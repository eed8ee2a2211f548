"""A user's plain extraction script (``hsfix_demo/user_script.py``, which does not import
vllm-hsfix) on vLLM's CPU build writes right files with vllm-hsfix installed. Dense tiny
model: no linear attention, so the run is exactly a user's. Without vllm-hsfix each
release fails as its patches' failing-first tests show (test_cpu_connector_save.py); the worker's
patches and in-situ check: test_e2e.py's plugin test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import CACHE, INSTALL

from hsfix_demo import e2e, script_run

pytestmark = [pytest.mark.e2e, pytest.mark.needs_vllm]

if not (INSTALL.cpu_build and not torch.cuda.is_available()):
    pytest.skip("needs vLLM's CPU build on a machine without CUDA", allow_module_level=True)


def test_with_vllm_hsfix_the_script_writes_correct_files_row_by_row(tmp_path: Path) -> None:
    r = script_run.run_user_script(hsfix=True, workdir=tmp_path, models=CACHE / "models")
    print(r.summary())
    assert r.rc == 0, (r.summary(), r.errors, r.log)
    c = r.comparison
    assert len(r.files) == c["requests"] == 2, r.summary()
    assert c["rows"] > 0 and c["rows_correct"] == c["rows"], r.summary()
    assert c["max_rel_err"] < e2e.THRESHOLD and c["rows_nan"] == 0 and c["rows_zero"] == 0
    assert not c["mismatched"], c["mismatched"]
