"""The shared-prefix check of ``vllm-hsfix audit`` on crafted datasets with causal rows,
whichever way the sketch store keeps its sketches."""

from __future__ import annotations

import errno
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from support.hsfiles import PREFIX_AUX as A
from support.hsfiles import dataset
from support.procs import audit_child

from vllm_hsfix.audit import pipeline, prefix, reports, scan


def prefix_flags(report: reports.AuditReport) -> dict[str, str]:
    return {
        Path(f.path).name: p.detail
        for f in report.files
        for p in f.problems
        if p.code == "prefix_mismatch"
    }


def test_a_correct_dataset_has_no_finding_and_says_what_it_checked(tmp_path: Path) -> None:
    report = pipeline.audit_paths(dataset(tmp_path), workers=1)
    assert prefix_flags(report) == {}
    assert report.count(reports.OK) == 25
    pre = report.dataset["prefix"]
    assert pre["files_checked"] == 20 and pre["files_unchecked"] == 5
    assert pre["groups_without_consensus"] == 0
    assert 0 < pre["max_agreeing_distance"] < prefix.TOLERANCE / 2


@pytest.mark.parametrize("scale", [1.0, 3e4], ids=["unit", "large-activations"])
def test_files_holding_other_memory_are_flagged_at_their_first_row(
    tmp_path: Path, scale: float
) -> None:
    """Also with activations whose projections overflow float16 (large models)."""
    report = pipeline.audit_paths(dataset(tmp_path, wrong={2, 9, 15}, scale=scale), workers=2)
    flags = prefix_flags(report)
    assert set(flags) == {"f002.safetensors", "f009.safetensors", "f015.safetensors"}
    assert all(
        d.startswith("row 0 (aux slot 0) differs from the consensus of the 20")
        for d in flags.values()
    )
    assert {Path(p).name for p in report.regenerate} == set(flags)


def test_a_wrong_file_outside_any_shared_prefix_cannot_be_caught(tmp_path: Path) -> None:
    report = pipeline.audit_paths(dataset(tmp_path, wrong={22}), workers=1)
    assert prefix_flags(report) == {}  # documented limit: nothing to compare it with


def test_a_dataset_written_entirely_wrong_has_no_reference_and_every_file_is_flagged(
    tmp_path: Path,
) -> None:
    report = pipeline.audit_paths(dataset(tmp_path, wrong=set(range(20))), workers=1)
    flags = prefix_flags(report)
    assert len(flags) == 20
    assert all("no majority of them agree" in d for d in flags.values())
    # The 20 files share the template and nothing longer: one group, counted once (not
    # once per prefix position it was checked at).
    assert report.dataset["prefix"]["groups_without_consensus"] == 1
    assert report.dataset["prefix"]["groups"] == 1


@pytest.mark.parametrize(
    ("wrong", "flagged"),
    [({0, 1, 2}, set(range(5))), ({3, 4}, {3, 4})],
    ids=["right-minority", "right-majority"],
)
def test_right_files_among_wrong_ones_that_share_their_prefix(
    tmp_path: Path, wrong: set[int], flagged: set[int]
) -> None:
    """5 files share a prefix, ``wrong`` hold other memory: a strict majority of right files
    is the consensus and only wrong ones are flagged; without one, every file of the group is
    flagged with "no majority" (repair then keeps the right ones, docs/audit.md)."""
    report = pipeline.audit_paths(dataset(tmp_path, wrong=wrong, n_shared=5, n_alone=0), workers=1)
    flags = prefix_flags(report)
    assert flags.keys() == {f"f{i:03d}.safetensors" for i in flagged}
    assert {Path(p).name for p in report.regenerate} == set(flags)
    right_flagged = [d for n, d in flags.items() if int(n[1:4]) not in wrong]
    assert all("no majority of them agree" in d for d in right_flagged)
    if len(flagged) < 5:
        assert all("differs from the consensus" in d for d in flags.values())


def test_zero_rows_never_vote(tmp_path: Path) -> None:
    """4 files with all-zero prefix rows (corrupt anyway) and 3 right ones: the zeros
    agree with each other but are not sound, so the right files stay unflagged."""
    paths = dataset(tmp_path, n_shared=7, n_alone=0)
    for p in paths[:4]:
        from safetensors.torch import load_file

        t = load_file(str(p))
        t["hidden_states"][:3] = 0
        save_file(t, str(p))
    report = pipeline.audit_paths(paths, workers=1)
    assert prefix_flags(report) == {}
    assert [f.verdict for f in report.files] == [reports.CORRUPT] * 4 + [reports.OK] * 3


def test_json_output_leaves_the_sketches_out(tmp_path: Path) -> None:
    report = pipeline.audit_paths(dataset(tmp_path, n_shared=3, n_alone=0), workers=1)
    doc = report.to_dict()
    assert "prefix" not in doc["files"][0] and doc["dataset"]["prefix"]["files_checked"] == 3


@pytest.mark.parametrize("n", [1, 2])
def test_tiny_groups(tmp_path: Path, n: int) -> None:
    report = pipeline.audit_paths(dataset(tmp_path, n_shared=n, n_alone=1), workers=1)
    assert prefix_flags(report) == {}
    assert report.dataset["prefix"]["files_checked"] == (n if n > 1 else 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_sketches_are_of_the_rows_the_scan_read_even_across_blocks(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """Hidden 8192: a scan block (1 MB) holds fewer rows than the 16 x 3 the prefix
    check keeps, so the copy is assembled from several blocks."""
    import numpy as np

    hs = torch.randn(20, A, 8192, generator=torch.Generator().manual_seed(2)).to(dtype)
    path = tmp_path / "big.safetensors"
    save_file({"hidden_states": hs, "token_ids": torch.arange(20)}, str(path))
    rep = scan.audit_file(path)
    want = prefix.sketch_rows(hs[: prefix.PREFIX_ROWS].float().numpy())
    got = rep.prefix.sketches.astype(np.float32) * rep.prefix.norms[..., None]
    assert rep.prefix.token_ids == tuple(range(prefix.PREFIX_ROWS))
    assert np.allclose(got, want, rtol=2e-3, atol=2e-3 * float(np.abs(want).max()))


def test_the_verdicts_do_not_depend_on_the_order_workers_return_files_in() -> None:
    """A near tie (9 files vs 8) gets the same verdicts whatever order the workers return."""
    import random

    import numpy as np

    rng = np.random.default_rng(0)
    right, wrong = rng.standard_normal(32), rng.standard_normal(32)

    def contribution(row: np.ndarray) -> prefix.PrefixData:
        unit = np.tile(row / np.linalg.norm(row), (3, 1, 1)).astype(np.float16)
        ones = np.ones((3, 1))
        return prefix.PrefixData((5, 6, 7), unit, ones.astype(np.float32), ones > 0, (1, 8))

    rows = [right] * 9 + [wrong] * 8
    arrival = list(range(len(rows)))
    random.Random(0).shuffle(arrival)
    found = []
    for order in (range(len(rows)), arrival):
        store = prefix.Store()
        for i in order:
            store.add(i, contribution(rows[i]))
        result = prefix.check(store, np.arange(len(rows)), len(rows))
        found.append(sorted(result.findings))
    assert found[0] == found[1]
    # In input order the sample of 16 (evenly spaced over the 17) leaves out file 8: 8
    # of each, no strict majority, so no file of the group can be trusted: all flagged.
    assert found[0] == list(range(17)), found[0]


def test_one_blas_thread_inside_and_the_same_sketches() -> None:
    from threadpoolctl import threadpool_info

    def blas_threads() -> list[int]:
        return [x["num_threads"] for x in threadpool_info() if x["user_api"] == "blas"]

    before = blas_threads()
    rows = np.random.default_rng(0).standard_normal((16, 4, 4096)).astype(np.float32)
    stacked = prefix.sketch_rows(rows)
    with prefix.single_blas_thread() as on:
        assert on and blas_threads() and set(blas_threads()) == {1}
        flat = prefix.sketch_rows(rows)
    assert blas_threads() == before
    want = rows.astype(np.float64) @ prefix.sketch_matrix(4096).astype(np.float64)
    np.testing.assert_allclose(flat, want, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(stacked, want, rtol=1e-4, atol=1e-3)


def test_a_blas_loaded_after_the_first_batch_is_held_to_one_thread_too() -> None:
    """A BLAS a later import loads is held to one thread too, then given its threads back."""
    out = audit_child("blas_threads")
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["on"] and got["before"] and set(got["inside"]) == {1}, got
    assert got["after"] == got["before"], got


N_AUX, HIDDEN = 4, 64


def contributions(n: int, wrong: set[int], seed: int = 0) -> list[prefix.PrefixData]:
    """``n`` files sharing a 6-token template (and 2 more tokens by threes), rows causal up to
    noise; files in ``wrong`` hold unrelated rows from position 3 on."""
    rng = np.random.default_rng(seed)
    template = rng.integers(0, 50_000, 6)
    base = rng.standard_normal((prefix.PREFIX_ROWS, N_AUX, HIDDEN)).astype(np.float32)
    out = []
    for i in range(n):
        ids = np.concatenate([template, [i // 3, i // 3], rng.integers(0, 50_000, 8)])
        rows = base.copy()
        rows[6:] = rng.standard_normal(rows[6:].shape)  # past the template: its own
        rows[6:8] = np.random.default_rng(i // 3).standard_normal(rows[6:8].shape)
        rows += rng.standard_normal(rows.shape).astype(np.float32) * 0.01
        if i in wrong:
            rows[3:] = rng.standard_normal(rows[3:].shape)
        zero = np.zeros((prefix.PREFIX_ROWS, N_AUX), bool)
        head = rows.reshape(-1, HIDDEN)
        shape = (prefix.PREFIX_ROWS, N_AUX, HIDDEN)
        out.append(prefix.from_head(head, shape, ids, zero, zero))
    return out


def run_check(data: list[prefix.PrefixData]) -> prefix.PrefixResult:
    with prefix.Store() as store:
        for i, p in enumerate(data):
            store.add(i, p)
        return prefix.check(store, np.arange(len(data)), len(data))


def summary(r: prefix.PrefixResult) -> tuple[Any, ...]:
    flags = {i: (f.position, f.aux, f.group_size) for i, f in r.findings.items()}
    return flags, r.checked, r.groups, r.no_consensus_groups, round(r.max_agreeing_distance, 6)


WRONG = {3, 40, 77, 100}  # one in each of their threes


@pytest.fixture(scope="module")
def data() -> list[prefix.PrefixData]:
    return contributions(120, WRONG)


@pytest.fixture(scope="module")
def expected(data: list[prefix.PrefixData]) -> tuple[Any, ...]:
    got = summary(run_check(data))
    # Against what was built, not against the code: exactly the wrong files, each at
    # the first row it got from elsewhere (3), in the group of all 120 files.
    assert got[0] == {i: (3, 0, 120) for i in WRONG}
    assert got[1] == 120
    return got


def test_the_sketches_go_to_disk_and_come_back_as_they_went_in() -> None:
    one = contributions(1, set())[0]
    n = 3_000
    with prefix.Store() as store:
        for i in range(n):
            store.add(i, one)
        cols = next(iter(store.values()))
        back = cols.rows(np.array([0, n - 1]), 5)
        assert not any(isinstance(f, io.BytesIO) for f in cols._spill)
    want = one.sketches[5].astype(np.float32) * one.norms[5][:, None]
    np.testing.assert_array_equal(back, np.stack([want, want]))


def test_the_same_verdicts_with_the_sketches_in_memory_when_no_temporary_file_can_be_made(
    data: list[prefix.PrefixData],
    expected: tuple[Any, ...],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "missing"))
    with prefix.Store() as store:
        store.add(0, data[0])
        assert all(isinstance(f, io.BytesIO) for f in next(iter(store.values()))._spill)
    assert summary(run_check(data)) == expected


def test_the_same_verdicts_when_the_disk_fills_up_half_way(
    data: list[prefix.PrefixData], expected: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that takes three chunks and then refuses: what was written is read back
    and the rest stays in memory; nothing is lost, no error reaches the user."""
    monkeypatch.setattr(prefix, "CHUNK", 16)
    real = prefix.tempfile.TemporaryFile
    refused = []

    class Full:  # the real temporary file, refusing its fourth write
        def __init__(self, *a: Any, **k: Any) -> None:
            self.f, self.writes = real(*a, **k), 0

        def write(self, b: Any) -> int:
            self.writes += 1
            if self.writes > 3:
                refused.append(1)
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

    monkeypatch.setattr(prefix.tempfile, "TemporaryFile", Full)
    assert summary(run_check(data)) == expected
    assert len(refused) == prefix.PREFIX_ROWS  # each position's file, once


def test_the_same_verdicts_when_huge_groups_are_compared_a_chunk_at_a_time(
    data: list[prefix.PrefixData], expected: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prefix, "GROUP_CHUNK", 7)
    assert summary(run_check(data)) == expected


def test_token_ids_past_int32_keep_every_verdict(
    data: list[prefix.PrefixData],
) -> None:
    """Ids past 2**40 in half the files: exactly the wrong files flagged, each in its half."""
    import dataclasses

    far = [
        p if i < 60 else dataclasses.replace(p, token_ids=tuple(t + 2**40 for t in p.token_ids))
        for i, p in enumerate(data)
    ]
    with prefix.Store() as store:
        for i, p in enumerate(far):
            store.add(i, p)
        got = summary(prefix.check(store, np.arange(len(far)), len(far)))
    assert got[0] == {i: (3, 0, 60) for i in WRONG}
