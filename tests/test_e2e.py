"""End to end on the real vLLM: the hidden states it writes, against a reference.

Marked ``e2e`` (minutes: one vLLM run is 40-60 s on 2 cores). The runner runs them
on 0.24.0 (affected) and 0.25.0 (fixed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CACHE

from vllm_hsfix.demo import e2e

pytestmark = [pytest.mark.e2e, pytest.mark.needs_vllm]

_RESULTS: dict[tuple[str, bool], e2e.Result] = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


def result(case: str, patched: bool, workdir: Path) -> e2e.Result:
    key = (case, patched)
    if key not in _RESULTS:
        _RESULTS[key] = e2e.run_case(
            e2e.CASES[case], patched=patched, workdir=workdir, models=CACHE / "models"
        )
    r = _RESULTS[key]
    assert r.ok_run, r.error
    return r


def _roles(r: e2e.Result) -> dict[str, dict[str, Any]]:
    return {s["role"]: s for s in r.statuses}


@pytest.mark.affected
@pytest.mark.parametrize("case", ["hybrid-mp", "hybrid-1aux"])
def test_unpatched_024_hybrid_is_wrong(case: str, workdir: Path) -> None:
    r = result(case, False, workdir)
    # This is what proves the test can fail: the release's own code saves wrong rows.
    assert r.rows > 0 and r.rows_correct == 0, r.as_dict()
    assert r.max_rel_err > 0.5
    reads = {(b["connector_block_size"], b["buffer_block_size"]) for b in r.block_sizes}
    assert all(read != buf for read, buf in reads), reads


@pytest.mark.affected
@pytest.mark.parametrize("case", ["hybrid-mp", "hybrid-1aux"])
def test_patched_024_hybrid_matches_the_reference_row_by_row(case: str, workdir: Path) -> None:
    r = result(case, True, workdir)
    assert r.rows_correct == r.rows > 0, r.as_dict()
    assert r.rows_zero == 0 and r.max_rel_err < e2e.THRESHOLD
    assert all(b["connector_block_size"] == b["buffer_block_size"] for b in r.block_sizes)


@pytest.mark.affected
def test_engine_core_and_worker_processes_are_patched_by_the_plugin(workdir: Path) -> None:
    """No code change in the run: vLLM's plugin loading patched each process it made."""
    roles = _roles(result("hybrid-mp", True, workdir))
    assert {"main", "engine-core", "worker-0"} <= set(roles), roles
    worker = roles["worker-0"]
    assert worker["patches"] == {
        "scatter-clamp": "applied",
        "hidden-group-block-size": "applied",
        "cpu-zero-blocks": "applied",
    }
    assert roles["engine-core"]["patches"]["hidden-group-block-size"] == "applied"
    # The in-situ check ran in the worker, on its device and dtype, and passed.
    assert worker["verify"]["ok"] is True and worker["verify"]["dtype"] == "bfloat16"


@pytest.mark.parametrize("patched", [False, True])
def test_dense_control_is_right(patched: bool, workdir: Path) -> None:
    r = result("dense-mp", patched, workdir)
    assert r.rows_correct == r.rows > 0, r.as_dict()


@pytest.mark.fixed
def test_fixed_release_is_right_and_left_byte_identical(workdir: Path) -> None:
    from safetensors.torch import load_file

    plain, with_pkg = result("hybrid-mp", False, workdir), result("hybrid-mp", True, workdir)
    assert plain.rows_correct == plain.rows > 0
    for s in with_pkg.statuses:
        assert set(s["patches"].values()) <= {"skipped", "pending"}, s
    assert len(plain.files) == len(with_pkg.files) > 0
    for a, b in zip(plain.files, with_pkg.files, strict=False):
        ta, tb = load_file(a), load_file(b)
        assert ta.keys() == tb.keys()
        for k in ta:
            assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape
            assert ta[k].view(-1).view(torch.uint8).equal(tb[k].view(-1).view(torch.uint8)), k


def _audit(files: list[str]) -> dict[str, str]:
    from vllm_hsfix import audit

    report = audit.audit_paths(files, workers=1)
    return {f.path: f.verdict for f in report.files}


@pytest.mark.affected
def test_audit_flags_every_unpatched_file_with_zero_rows_and_no_good_file(workdir: Path) -> None:
    """`vllm-hsfix audit` on what the real vLLM wrote (issue: find the corrupted files)."""
    from safetensors.torch import load_file

    bad, good = result("hybrid-mp", False, workdir), result("hybrid-mp", True, workdir)
    verdicts = _audit(bad.files)
    with_zero_rows = [
        f for f in bad.files if (load_file(f)["hidden_states"].float().abs().amax(-1) == 0).any()
    ]
    assert with_zero_rows, "the unpatched run should have written all-zero rows"
    assert all(verdicts[f] == "corrupt" for f in with_zero_rows), verdicts
    assert set(_audit(good.files).values()) == {"ok"}


@pytest.mark.fixed
def test_audit_flags_nothing_written_by_a_fixed_release(workdir: Path) -> None:
    files = result("hybrid-mp", False, workdir).files + result("hybrid-mp", True, workdir).files
    assert set(_audit(files).values()) == {"ok"}
