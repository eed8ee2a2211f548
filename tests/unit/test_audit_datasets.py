"""``vllm-hsfix audit`` on datasets: norm and shape outliers, directory expansion, and
workers (same answers for any count, crashes and stalls pinned on their file)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from support.hsfiles import A, H, hs_file, write_raw
from support.load import busy_cores

from vllm_hsfix.audit import command, parallel, pipeline, reports
from vllm_hsfix.audit.dataset import Ledger, dataset_pass
from vllm_hsfix.audit.reports import (
    CORRUPT,
    OK,
    PENDING,
    SUSPECT,
    UNSUPPORTED,
    FileReport,
    LayerStats,
)


def test_norm_outlier_among_good_files(tmp_path: Path) -> None:
    for i in range(10):
        hs_file(tmp_path / "ds" / f"good{i:02d}.safetensors", seed=i)
    hs_file(tmp_path / "ds" / "slightly.safetensors", seed=40, scale=1.02)
    off = hs_file(tmp_path / "ds" / "sub" / "scaled.safetensors", seed=41, scale=1000.0)
    report = pipeline.audit_paths([tmp_path / "ds"], workers=2)
    assert len(report.files) == 12
    by = {Path(f.path).name: f for f in report.files}
    assert by["scaled.safetensors"].verdict == "suspect"
    assert by["scaled.safetensors"].codes() == ["norm_outlier"] * A
    ratios = re.findall(r"is (\S+)x the dataset median", by["scaled.safetensors"].reason())
    assert len(ratios) == A and all(900 < float(r) < 1100 for r in ratios)
    assert all(f.verdict == "ok" for n, f in by.items() if n != "scaled.safetensors")
    # A heuristic's verdict is "look", never "regenerate": it may be wrong.
    assert report.suspect == [str(off)] and report.regenerate == []
    refs = report.dataset["norm_reference"]
    assert [r["aux"] for r in refs] == [0, 1, 2]
    assert all(15 < r["median"] < 17 and r["files"] == 12 for r in refs)


def test_norm_pass_uses_medians_so_one_big_row_is_fine(tmp_path: Path) -> None:
    """A short file with one attention-sink row (norm x300) is no dataset outlier."""
    for i in range(6):
        hs_file(tmp_path / f"g{i}.safetensors", seed=i)

    def sink(hs: torch.Tensor, ids: torch.Tensor) -> None:
        hs[0] *= 300

    hs_file(tmp_path / "sink.safetensors", seed=99, edit=sink)
    report = pipeline.audit_paths([tmp_path], workers=1)
    assert [f.verdict for f in report.files] == ["ok"] * 7


def test_shape_outlier_is_suspect(tmp_path: Path) -> None:
    for i in range(4):
        hs_file(tmp_path / f"g{i}.safetensors", seed=i)
    odd = hs_file(tmp_path / "odd.safetensors", hidden=128)
    report = pipeline.audit_paths([tmp_path], workers=1)
    by = {f.path: f for f in report.files}
    assert by[str(odd)].codes() == ["shape_outlier"]
    assert report.dataset["majority_shape"] == [A, H]
    assert report.count("ok") == 4


def test_directories_expand_recursively_and_skip_locks(tmp_path: Path) -> None:
    a = hs_file(tmp_path / "d" / "b.safetensors")
    b = hs_file(tmp_path / "d" / "x" / "a.safetensors")
    write_raw(tmp_path / "d" / "b.safetensors.lock", b"")
    write_raw(tmp_path / "d" / "notes.txt", b"hello")
    lock = tmp_path / "d" / "b.safetensors.lock"
    files = pipeline.expand_paths([tmp_path / "d", a, lock])
    assert files == [str(a), str(b)]
    # One file named twice (another spelling, a link to it) is audited once, under
    # the first name given.
    link = tmp_path / "link.safetensors"
    link.symlink_to(b)
    again = pipeline.expand_paths([a, str(tmp_path / "d" / "." / "b.safetensors"), link, b])
    assert again == [str(a), str(link)]
    with pytest.raises(FileNotFoundError):
        pipeline.expand_paths([tmp_path / "nope"])


def test_workers_do_not_change_the_answers(tmp_path: Path) -> None:
    for i in range(5):
        hs_file(tmp_path / f"g{i}.safetensors", seed=i)
    hs_file(tmp_path / "z.safetensors", edit=lambda hs, ids: hs[3].zero_())
    write_raw(tmp_path / "junk.safetensors", b"junk" * 100)
    one = pipeline.audit_paths([tmp_path], workers=1)
    two = pipeline.audit_paths([tmp_path], workers=2)
    assert two.workers == 2 and one.workers == 1
    assert [(f.path, f.verdict, f.codes()) for f in one.files] == [
        (f.path, f.verdict, f.codes()) for f in two.files
    ]
    assert one.count("corrupt") == 2
    with pytest.raises(ValueError):
        pipeline.audit_paths([tmp_path], workers=0)


_REAL_AUDIT_FILES = parallel.audit_files


def _dies_on_boom(paths: list[str]) -> list[reports.FileReport]:
    """Stands in for a worker killed mid-file (SIGBUS on a file shrunk under its map)."""
    if any("boom" in os.fspath(p) for p in paths):
        os._exit(3)
    return _REAL_AUDIT_FILES(paths)


def _always_dies(paths: list[str]) -> list[reports.FileReport]:
    os._exit(3)


def _fork_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The crash is injected into this process, which only forked workers inherit; the pool
    forks only while this process has one thread."""
    import multiprocessing

    monkeypatch.setattr(parallel, "_context", lambda: multiprocessing.get_context("fork"))


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy-cores"])
def test_a_worker_crash_is_pinned_on_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, busy: bool
) -> None:
    """``busy-cores``: every core spins meanwhile (the broken pool's retries starve)."""
    for i in range(3):
        hs_file(tmp_path / f"g{i}.safetensors", seed=i)
    boom = hs_file(tmp_path / "boom.safetensors", seed=9)
    _fork_workers(monkeypatch)
    monkeypatch.setattr(parallel, "audit_files", _dies_on_boom)
    with busy_cores() if busy else contextlib.nullcontext():
        report = pipeline.audit_paths([tmp_path], workers=2, stall_s=120)
    by = {f.path: f for f in report.files}
    assert by[str(boom)].verdict == "corrupt" and by[str(boom)].codes() == ["unreadable"]
    assert "worker died" in by[str(boom)].reason()
    assert by[str(boom)].bytes == boom.stat().st_size
    assert [f.verdict for p, f in by.items() if p != str(boom)] == ["ok"] * 3


def _hangs_alone_on_boom(paths: list[str]) -> list[reports.FileReport]:
    """Dies on a batch holding ``boom`` and never returns on ``boom`` alone (a read
    that hangs after the first attempt's worker died)."""
    if any("boom" in os.fspath(p) for p in paths):
        if len(paths) > 1:
            os._exit(3)
        time.sleep(3600)
    return _REAL_AUDIT_FILES(paths)


def test_a_file_whose_read_never_returns_ends_the_run_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A FIFO nobody writes holds its worker forever: with ``--stall-timeout 2`` the command
    exits 2 naming it, reports the other files and leaves no worker behind."""
    import multiprocessing

    for i in range(3):
        hs_file(tmp_path / f"g{i}.safetensors", seed=i)
    fifo = tmp_path / "h.safetensors"  # sorts last: a batch of its own (4 files, 2 workers)
    os.mkfifo(fifo)
    t0 = time.monotonic()
    argv = [str(tmp_path), "--workers", "2", "--stall-timeout", "2", "--no-progress"]
    assert command.main([*argv, "--jsonl", str(tmp_path / "r.jsonl")]) == 2
    assert time.monotonic() - t0 < 30
    err = capsys.readouterr().err
    assert f"came back for 2 s (--stall-timeout): 1 still out, not judged: {fifo}. " in err
    recs = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    judged = sorted(r["path"] for r in recs if r["type"] == "file")
    assert judged == [str(tmp_path / f"g{i}.safetensors") for i in range(3)]
    assert multiprocessing.active_children() == []


def test_a_fifo_first_in_line_is_left_to_the_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The driver looks at the first file's header (to load the fp8 kernel before its
    workers start) but never opens a FIFO: the run ends by the stall timeout, naming it."""
    os.mkfifo(tmp_path / "a.safetensors")
    hs_file(tmp_path / "b.safetensors")
    t0 = time.monotonic()
    argv = [str(tmp_path), "--workers", "1", "--stall-timeout", "2", "--no-progress"]
    assert command.main(argv) == 2
    assert time.monotonic() - t0 < 30
    assert f"not judged: {tmp_path / 'a.safetensors'}; " in capsys.readouterr().err


def test_a_file_that_hangs_when_retried_alone_ends_the_run_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bound holds in the one-file-per-process retry after a crash too."""
    import multiprocessing

    for i in range(7):
        hs_file(tmp_path / f"g{i}.safetensors", seed=i)
    boom = hs_file(tmp_path / "boom.safetensors", seed=9)  # 8 files, 1 worker: batches of 2
    _fork_workers(monkeypatch)
    monkeypatch.setattr(parallel, "audit_files", _hangs_alone_on_boom)
    t0 = time.monotonic()
    with pytest.raises(parallel.Stalled, match=f"1 still out, not judged: {re.escape(str(boom))}"):
        pipeline.audit_paths([tmp_path], workers=1, stall_s=2)
    assert time.monotonic() - t0 < 30
    assert multiprocessing.active_children() == []


def test_workers_that_cannot_run_are_not_blamed_on_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hs_file(tmp_path / "g.safetensors")
    _fork_workers(monkeypatch)
    monkeypatch.setattr(parallel, "audit_files", _always_dies)
    with pytest.raises(RuntimeError, match="cannot run"):
        pipeline.audit_paths([tmp_path], workers=1)
    assert command.main([str(tmp_path)]) == 2
    assert "cannot run" in capsys.readouterr().err


def test_a_workers_batch_crosses_the_process_boundary_whole(tmp_path: Path) -> None:
    """A worker's batch (``parallel.run_batch``, pickled) comes back as the same reports, every
    field included, for clean, damaged, sketchless and differently shaped files."""
    import pickle

    paths = [
        hs_file(tmp_path / "a.safetensors", seed=1),
        hs_file(tmp_path / "z.safetensors", seed=3, edit=lambda h, i: h[2, 1].zero_()),
        write_raw(tmp_path / "junk.safetensors", b"junk" * 9),
        hs_file(tmp_path / "w.safetensors", seed=4, tokens=5, n_aux=2, hidden=128),
        hs_file(tmp_path / "b.safetensors", seed=5, tokens=40),
    ]
    got = parallel.run_batch([str(p) for p in paths])
    got[1].problems[0].hazard = "torn-files"
    got[1].provenance = {"vllm_hsfix.version": "x"}
    back = pickle.loads(pickle.dumps(got, protocol=pickle.HIGHEST_PROTOCOL))
    assert [type(r) for r in back] == [reports.FileReport] * len(paths)
    assert [r.to_dict() for r in back] == [r.to_dict() for r in got]
    assert [r.verdict for r in back] == ["ok", "corrupt", "corrupt", "ok", "ok"]
    assert [r.prefix is None for r in back] == [False, False, True, False, False]
    assert back[1].problems[0].hazard == "torn-files" and back[1].provenance == {
        "vllm_hsfix.version": "x"
    }
    for b, r in zip(back, got, strict=True):
        assert b.layers == r.layers and b.problems == r.problems
        if r.prefix is not None:
            assert b.prefix.token_ids == r.prefix.token_ids
            assert b.prefix.shape_key == r.prefix.shape_key
            for name in ("sketches", "norms", "sound"):
                want = getattr(r.prefix, name)
                assert np.array_equal(getattr(b.prefix, name), want)
                assert getattr(b.prefix, name).dtype == want.dtype


def test_many_named_files_are_deduplicated(tmp_path: Path) -> None:
    """The command hands its expanded list back to ``audit_paths``: 20,000 named files
    (one named twice, one under a second spelling) come back once each, in order."""
    names = []
    for i in range(20_000):
        p = tmp_path / f"hs_{i}.safetensors"
        p.touch()
        names.append(str(p))
    out = pipeline.expand_paths([*names, names[5], str(tmp_path / "." / "hs_7.safetensors")])
    assert out == names


def report(i: int, medians: list[float | None], shape: tuple[int, int] = (4, 64)) -> FileReport:
    layers = [LayerStats(a, 10, m, 0.1, m, m, m) for a, m in enumerate(medians)]
    return FileReport(
        path=f"hs_{i}.safetensors", n_tokens=10 + i, n_aux=shape[0], hidden=shape[1], layers=layers
    )


def test_outliers_and_shapes_by_file_index() -> None:
    """60 files with layer medians spread around 1-4: exactly file 7 (layer 2) and 11 (layer
    0) are norm outliers, 13 a shape outlier, and each layer's reference counts the files that
    had its median (17 has none on layer 1; one file lacks a layer)."""
    rng = np.random.default_rng(1)
    n = 64
    ledger = Ledger(n)
    base = np.array([1.0, 2.0, 3.0, 4.0])
    for i in range(n):
        m: list[float | None] = list(base * (1 + 0.02 * rng.uniform(-1, 1, 4)))
        shape = (4, 64)
        if i == 7:
            m[2] = 30.0
        if i == 11:
            m[0] = 1.0 / 3
        if i == 13:
            shape = (3, 64)
            m = m[:3]
        if i == 17:
            m[1] = None
        if i == 19:
            m = m[:3]  # a layer short (its report had three)
        rep = report(i, m, shape)
        if i == 21:
            rep.verdict = PENDING
            continue  # the pipeline keeps pending files out of the ledger
        if i == 23:
            rep.verdict = UNSUPPORTED
        if i == 29:
            rep.verdict = CORRUPT  # judged: still compared (its finding stays corrupt)
        ledger.put(i, rep)
    judged = ledger.judged()
    assert 21 not in judged and 23 not in judged and len(judged) == n - 2
    findings: dict = {}
    info = dataset_pass(ledger, judged, findings)
    assert {i: [p.code for p in ps] for i, ps in findings.items()} == {
        7: ["norm_outlier"],
        11: ["norm_outlier"],
        13: ["shape_outlier"],
    }
    assert "aux slot 2: median row norm 30 is" in findings[7][0].detail
    assert info["majority_shape"] == [4, 64]
    refs = {(r["n_aux"], r["aux"]): r["files"] for r in info["norm_reference"]}
    # [4, 64]: 62 judged, one of them of [3, 64]; 61 left; layer 1 lacks file 17,
    # layer 3 lacks file 19 (three layers). [3, 64]: one file, too few to compare.
    assert refs == {(4, 0): 61, (4, 1): 60, (4, 2): 61, (4, 3): 60}
    verdicts = ledger.verdicts()
    assert verdicts[7] == SUSPECT and verdicts[13] == SUSPECT and verdicts[29] == CORRUPT
    assert verdicts[0] == OK and verdicts[21] is None and verdicts[23] == UNSUPPORTED


def test_no_majority_no_shape_outliers() -> None:
    """Two shapes in equal numbers: no majority, so nobody is a shape outlier."""
    ledger = Ledger(6)
    for i in range(6):
        ledger.put(i, report(i, [1.0, 2.0], (2, 64 if i % 2 else 128)))
    findings: dict = {}
    info = dataset_pass(ledger, ledger.judged(), findings)
    assert info["majority_shape"] is None and findings == {}
