"""Where the shared-prefix check keeps its sketches until the dataset pass.

At speculators' scale (10^6 files) the driver held about 4.5 KB of sketches a file in
memory; they now go to a temporary file (:mod:`vllm_hsfix.audit.prefix_columns`). These
tests hold the memory to what the design allows, and the verdicts to the ones the
check gives however the sketches are kept: on disk, in memory where no temporary file
can be made, after a disk fills up half-way, and with huge groups read in chunks.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vllm_hsfix.audit import prefix, prefix_columns

N_AUX, HIDDEN = 4, 64


def contributions(n: int, wrong: set[int], seed: int = 0) -> list[prefix.PrefixData]:
    """``n`` files sharing a 6-token template (then 2 more tokens shared by threes of
    files), rows causal like a model's: files sharing tokens share rows, up to bf16-like
    noise; the files in ``wrong`` hold unrelated rows from position 3 on."""
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
    """The sketches wait in a temporary file (their memory budget is measured by
    ``benchmarks/bench_audit.py``): each one read back is what went in."""
    one = contributions(1, set())[0]
    n = 3_000
    with prefix.Store() as store:
        for i in range(n):
            store.add(i, one)
        cols = store.shapes()[0]
        assert cols._spill is not None
        back = cols.rows(np.array([0, n - 1]), 5)
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
        assert store.shapes()[0]._spill is None  # it really did fall back
    assert summary(run_check(data)) == expected


def test_the_same_verdicts_when_the_disk_fills_up_half_way(
    data: list[prefix.PrefixData], expected: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that takes the first records and then refuses: what was written is read
    back and the rest stays in memory; nothing is lost, no error reaches the user."""
    monkeypatch.setattr(prefix_columns, "_CHUNK", 16)
    real = prefix_columns.tempfile.TemporaryFile
    writes = []

    class Full:  # the real temporary file, refusing writes after the third
        def __init__(self, *a: Any, **k: Any) -> None:
            self.f = real(*a, **k)

        def write(self, b: Any) -> int:
            writes.append(len(b))
            if len(writes) > 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

    monkeypatch.setattr(prefix_columns.tempfile, "TemporaryFile", Full)
    assert summary(run_check(data)) == expected
    assert len(writes) == 4  # three chunks on disk, then the full disk, then memory


@pytest.mark.parametrize("dense", [1, 1 << 20], ids=["cell-reads", "block-reads"])
def test_the_same_verdicts_when_huge_groups_are_read_a_chunk_at_a_time(
    data: list[prefix.PrefixData],
    expected: tuple[Any, ...],
    monkeypatch: pytest.MonkeyPatch,
    dense: int,
) -> None:
    """Groups compared 7 files at a time, their sketches read cell by cell or a
    position's whole block per chunk."""
    monkeypatch.setattr(prefix, "GROUP_CHUNK", 7)
    monkeypatch.setattr(prefix_columns, "_DENSE", dense)
    assert summary(run_check(data)) == expected


def test_token_ids_past_int32_widen_the_column_and_keep_every_verdict(
    data: list[prefix.PrefixData],
) -> None:
    """Token ids are kept as int32 (every vocabulary fits); a file whose ids do not fit
    (a corrupt or foreign file) widens the column half-way through, and the files
    before it keep theirs: the 120 files split into two templates of 60, the second's
    ids past 2**40, and exactly the wrong files are flagged, each in its own half."""
    import dataclasses

    far = [
        p if i < 60 else dataclasses.replace(p, token_ids=tuple(t + 2**40 for t in p.token_ids))
        for i, p in enumerate(data)
    ]
    with prefix.Store() as store:
        for i, p in enumerate(far):
            store.add(i, p)
        cols = store.shapes()[0]
        assert cols.tokens.dtype == np.int64
        assert cols.tokens[0, 0] == data[0].token_ids[0]
        assert cols.tokens[119, 0] == data[119].token_ids[0] + 2**40
        got = summary(prefix.check(store, np.arange(len(far)), len(far)))
    assert got[0] == {i: (3, 0, 60) for i in WRONG}
    with prefix.Store() as store:  # ids that fit stay int32
        for i, p in enumerate(data):
            store.add(i, p)
        assert store.shapes()[0].tokens.dtype == np.int32
