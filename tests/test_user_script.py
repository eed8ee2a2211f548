"""A user's plain extraction script on vLLM's CPU build, with and without vllm-hsfix.

``hsfix_demo/user_script.py`` does not import vllm-hsfix; it runs with vllm-hsfix
installed and with ``VLLM_HSFIX_DISABLE=1``. How the run without it fails was measured
per release (issue 22) and is written below, not derived from the patches. Dense tiny
model: no linear attention, so the run is exactly a user's. Which patches the worker
had, and its in-situ check: test_e2e.py's plugin test, on the same release."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import CACHE, INSTALL

from hsfix_demo import e2e, script_run

pytestmark = [pytest.mark.e2e, pytest.mark.needs_vllm, pytest.mark.dense_engine]

# release -> (text in an exception line, connector functions in its traceback), measured
# with this script without vllm-hsfix (torch 2.11.0 from PyPI, no CUDA driver):
# 0.22.0: the first save_kv_layer makes a CUDA stream (_get_copy_stream);
# 0.24.0: start-up dies in the rejection sampler, before any save;
# 0.25.0: the CPU worker's stream placeholder has no wait_event (_submit_async_write).
WITHOUT = {
    "0.22.0": ("CUDA", ["save_kv_layer", "_get_copy_stream"]),
    "0.24.0": ("unexpected keyword argument 'USE_FP64_GUMBEL'", []),
    "0.25.0": (
        "'_StreamPlaceholder' object has no attribute 'wait_event'",
        ["_submit_async_write"],
    ),
}

if not (INSTALL.cpu_build and not torch.cuda.is_available()):
    pytest.skip("needs vLLM's CPU build on a machine without CUDA", allow_module_level=True)

_RUNS: dict[bool, script_run.ScriptRun] = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("user-script")


def run(hsfix: bool, workdir: Path) -> script_run.ScriptRun:
    if hsfix not in _RUNS:
        _RUNS[hsfix] = script_run.run_user_script(
            hsfix=hsfix, workdir=workdir, models=CACHE / "models"
        )
    r = _RUNS[hsfix]
    print(r.summary())
    return r


@pytest.mark.extended
def test_without_vllm_hsfix_the_script_fails_as_measured(workdir: Path) -> None:
    """What proves the other test can fail: the release alone cannot extract on a CPU."""
    if INSTALL.release not in WITHOUT:
        pytest.skip(f"no measured failure recorded for vLLM {INSTALL.release}")
    r = run(False, workdir)
    text, frames = WITHOUT[INSTALL.release]
    assert r.rc != 0 and not r.files, r.summary()
    assert any(text in e for e in r.errors), (r.errors, r.log)
    assert set(frames) <= set(r.connector_frames), (r.connector_frames, r.log)


def test_with_vllm_hsfix_the_script_writes_correct_files_row_by_row(workdir: Path) -> None:
    r = run(True, workdir)
    assert r.rc == 0, (r.summary(), r.errors, r.log)
    c = r.comparison
    assert len(r.files) == c["requests"] == 2, r.summary()
    assert c["rows"] > 0 and c["rows_correct"] == c["rows"], r.summary()
    assert c["max_rel_err"] < e2e.THRESHOLD and c["rows_nan"] == 0 and c["rows_zero"] == 0
    assert not c["mismatched"], c["mismatched"]
