"""Where the shared-prefix check keeps its sketches until the dataset pass
(:class:`vllm_hsfix.audit.prefix.Store`: a temporary file per position). The verdicts
are the ones built into the data however the sketches are kept: on disk, in memory
where no temporary file can be made, after a disk fills up half-way, with huge groups
compared in chunks, and with token ids past int32.
"""

from __future__ import annotations

import errno
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vllm_hsfix.audit import prefix

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
    one = contributions(1, set())[0]
    n = 3_000
    with prefix.Store() as store:
        for i in range(n):
            store.add(i, one)
        cols = store.shapes()[0]
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
        assert all(isinstance(f, io.BytesIO) for f in store.shapes()[0]._spill)
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


def test_token_ids_past_int32_keep_every_verdict(data: list[prefix.PrefixData]) -> None:
    """The 120 files split into two templates of 60, the second's ids past 2**40:
    exactly the wrong files are flagged, each in its own half."""
    import dataclasses

    far = [
        p if i < 60 else dataclasses.replace(p, token_ids=tuple(t + 2**40 for t in p.token_ids))
        for i, p in enumerate(data)
    ]
    got = summary(run_check(far))
    assert got[0] == {i: (3, 0, 60) for i in WRONG}
