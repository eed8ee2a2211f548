"""``vllm-hsfix audit`` at the size of real datasets: split verdicts, ``--list``,
``--show``, ``--jsonl``, progress, ``--state``, pending files and the Python API."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path
from typing import Any

import pytest
from support.hsfiles import dataset, hs_file, make_mixed, write_raw
from support.procs import audit_child

import vllm_hsfix.audit as audit_api
from vllm_hsfix.audit import command, pipeline, progress

ROOT = Path(__file__).resolve().parents[2]


def test_list_writes_paths_only_and_keeps_corrupt_and_suspect_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = make_mixed(tmp_path / "d")  # corrupt: zero, junk; suspect: dup
    out = tmp_path / "out"
    out.mkdir()
    code = command.main(
        [
            str(tmp_path / "d"),
            "--list", "corrupt", str(out / "corrupt.txt"),
            "--list", "suspect", str(out / "suspect.txt"),
            "--list", "bad", "-",
        ]
    )  # fmt: skip
    cap = capsys.readouterr()
    assert code == 1
    assert (out / "corrupt.txt").read_text().splitlines() == sorted(
        [str(files["junk"]), str(files["zero"])]
    )
    assert (out / "suspect.txt").read_text().splitlines() == [str(files["dup"])]
    # stdout carries the list and nothing else; the summary goes to stderr.
    assert cap.out.splitlines() == sorted(str(files[k]) for k in ("dup", "junk", "zero"))
    assert "ok 4   suspect 1   corrupt 2" in cap.err


def test_text_shows_the_first_n_per_check_and_says_how_many_more(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    zeros = [
        hs_file(tmp_path / f"z{i:02d}.safetensors", seed=i, edit=lambda h, _: h[1].zero_())
        for i in range(12)
    ]
    assert command.main([str(tmp_path), "--show", "3"]) == 1
    text = capsys.readouterr().out
    assert "zero_rows (corrupt): 12 files" in text
    shown = [z for z in zeros if f"  {z}: " in text]
    assert shown == zeros[:3]  # the first by path, whatever the worker order
    assert "  ... 9 more (--show all, or --list corrupt FILE)" in text
    assert len(text.splitlines()) < 15
    assert command.main([str(tmp_path), "--show", "all"]) == 1
    text = capsys.readouterr().out
    assert all(f"  {z}: " in text for z in zeros) and "more (--show" not in text


def test_jsonl_streams_files_then_updates_then_summary_and_matches_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One run writes --jsonl, --json and --csv: the stream's last verdict per path is the JSON
    document's, and a norm outlier gets an update record."""
    for i in range(8):
        hs_file(tmp_path / "d" / f"g{i}.safetensors", seed=i)
    off = hs_file(tmp_path / "d" / "scaled.safetensors", seed=40, scale=1000.0)
    zero = hs_file(tmp_path / "d" / "zero.safetensors", seed=41, edit=lambda h, _: h[0].zero_())
    jl, cs = tmp_path / "r.jsonl", tmp_path / "r.csv"
    code = command.main(
        [str(tmp_path / "d"), "--json", "--jsonl", str(jl), "--csv", str(cs), "--workers", "2"]
    )
    doc = json.loads(capsys.readouterr().out)
    assert code == 1
    recs = [json.loads(x) for x in jl.read_text().splitlines()]
    types = [r["type"] for r in recs]
    assert types == ["file"] * 10 + ["update"] + ["summary"]
    (upd,) = (r for r in recs if r["type"] == "update")
    assert upd["path"] == str(off) and upd["verdict"] == "suspect"
    assert {p["code"] for p in upd["problems"]} == {"norm_outlier"}
    last: dict[str, str] = {}
    for r in recs[:-1]:
        last[r["path"]] = r["verdict"]
    assert last == {f["path"]: f["verdict"] for f in doc["files"]}
    assert last[str(zero)] == "corrupt"
    summary = recs[-1]
    assert summary["regenerate"] == doc["regenerate"] == [str(zero)]
    assert summary["suspect"] == doc["suspect"] == [str(off)]
    assert summary["totals"]["files"] == 10 and summary["schema"] == 3
    assert len(cs.read_text().splitlines()) == 11


def test_records_arrive_while_the_scan_runs_and_reports_are_not_kept(tmp_path: Path) -> None:
    for i in range(30):
        hs_file(tmp_path / f"g{i:02d}.safetensors", seed=i)
    events: list[tuple[str, str]] = []

    class Spy:
        def __init__(self, label: str) -> None:
            self.label = label

        def update(self, n: int = 1, nbytes: int = 0) -> None:
            events.append(("progress", self.label))

        def close(self) -> None:
            events.append(("close", self.label))

    report = pipeline.audit_paths(
        [tmp_path],
        workers=2,
        progress=lambda label, total, total_bytes=0: Spy(label),
        on_record=lambda r: events.append(("record", r["type"])),
        keep=False,
    )
    scan_end = events.index(("close", "scan"))
    first = events.index(("record", "file"))
    assert first < scan_end and events[scan_end - 1] == ("progress", "scan")
    assert events.count(("record", "file")) == 30 and events[-1] == ("record", "summary")
    assert report.files == [] and report.count("ok") == 30 and len(report.verdicts) == 30


def test_log_progress_is_a_line_every_interval_and_one_at_the_end() -> None:
    import io

    now = [0.0]
    buf = io.StringIO()
    bar = progress.LogLines("scan", 100, buf, interval=10.0, clock=lambda: now[0])
    for _ in range(100):
        now[0] += 0.25  # 25 s in all: lines at 10 s and 20 s, then the last one
        bar.update(1, 10_000_000)
    bar.close()
    bar.close()
    lines = buf.getvalue().splitlines()
    assert lines == [
        "audit scan: 40/100 files, 0.40 GB, 10.0 s, 4.0 files/s, 0.040 GB/s",
        "audit scan: 80/100 files, 0.80 GB, 20.0 s, 4.0 files/s, 0.040 GB/s",
        "audit scan: 100/100 files, 1.00 GB, 25.0 s, 4.0 files/s, 0.040 GB/s",
    ]


def test_a_terminal_gets_tqdm(tmp_path: Path) -> None:
    """stderr on a pseudo-terminal: tqdm draws (``\\r`` frames, its rate field)."""
    pytest.importorskip("tqdm")
    for i in range(6):
        hs_file(tmp_path / f"g{i}.safetensors", seed=i)
    master, slave = pty.openpty()
    # A real terminal has a size (a fresh pty is 0x0, where tqdm draws nothing).
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_hsfix", "audit", str(tmp_path), "--workers", "1"],
        stdout=subprocess.PIPE,
        stderr=slave,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="120"),
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    out, _ = proc.communicate(timeout=120)
    os.close(master)
    err = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, err
    assert "audit scan: 100%" in err and "6/6" in err and "\r" in err, err
    assert "file/s" in err, err
    assert b"result: all files ok" in out


def test_a_file_whose_writer_holds_the_lock_is_pending_not_judged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only a held lock on ``NAME.lock`` makes a file pending; a leftover ``.lock`` does not."""
    for i in range(3):
        hs_file(tmp_path / f"g{i}.safetensors", seed=i)
        write_raw(tmp_path / f"g{i}.safetensors.lock", b"")  # leftovers of finished writes
    half = write_raw(tmp_path / "writing.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    lock_fd = os.open(f"{half}.lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)  # the writer, mid-write
    try:
        assert command.main([str(tmp_path), "--json"]) == 0  # not corrupt: not judged yet
        doc = json.loads(capsys.readouterr().out)
        assert doc["pending"] == [str(half)] and doc["regenerate"] == []
        assert doc["totals"]["ok"] == 3 and doc["totals"]["pending"] == 1
        by = {f["path"]: f for f in doc["files"]}
        assert by[str(half)]["verdict"] == "pending"
        assert [p["code"] for p in by[str(half)]["problems"]] == ["locked"]
        assert audit_api.check_file(half).verdict == "pending"
    finally:
        os.close(lock_fd)  # the writer finishes (or dies: the kernel drops the lock)
    assert audit_api.check_file(half).verdict == "corrupt"
    assert command.main([str(tmp_path)]) == 1


def verdicts(report: Any) -> dict[str, tuple[str, list[str]]]:
    return {f.path: (f.verdict, sorted(f.codes())) for f in report.files}


def test_state_rescans_only_new_or_changed_files_and_still_checks_the_dataset(
    tmp_path: Path,
) -> None:
    """Unchanged files come from the state and the prefix check still sees them: an old wrong
    file is flagged again, a new one against the stored sketches' consensus."""
    root = tmp_path / "d"
    root.mkdir()
    paths = dataset(root, wrong={3})
    state = tmp_path / "audit.state"
    first = pipeline.audit_paths([root], workers=2, state=state)
    assert first.reused == 0
    assert verdicts(first)[str(paths[3])][0] == "corrupt"
    # One file rewritten (another wrong file now), one new file, one deleted.
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tmp2").mkdir()
    changed = dataset(tmp_path / "tmp", wrong={7})[7]
    os.replace(changed, paths[7])
    os.replace(dataset(tmp_path / "tmp2", n_shared=30, n_alone=0)[29], root / "new.safetensors")
    paths[10].unlink()
    second = pipeline.audit_paths([root], workers=2, state=state)
    fresh = pipeline.audit_paths([root], workers=2)
    assert second.reused == len(paths) - 2  # all but the rewritten and the deleted one
    assert verdicts(second) == verdicts(fresh)
    assert verdicts(second)[str(paths[7])][1] == ["prefix_mismatch"]
    assert verdicts(second)[str(paths[3])][1] == ["prefix_mismatch"]
    lines = state.read_text().splitlines()
    assert len(lines) == 1 + len(fresh.files)  # compacted: deleted file gone, no dups
    third = pipeline.audit_paths([root], workers=1, state=state)
    assert third.reused == len(fresh.files) and verdicts(third) == verdicts(fresh)


def test_state_survives_a_killed_run_and_ignores_other_versions(tmp_path: Path) -> None:
    root = tmp_path / "d"
    for i in range(4):
        hs_file(root / f"g{i}.safetensors", seed=i)
    state = tmp_path / "s.jsonl"
    pipeline.audit_paths([root], workers=1, state=state)
    # A run killed while appending: its last line cut short.
    text = state.read_text()
    state.write_text(text[: len(text) - 40])
    again = pipeline.audit_paths([root], workers=1, state=state)
    assert again.reused == 3 and again.count("ok") == 4
    header, *rest = state.read_text().splitlines()
    state.write_text(json.dumps({**json.loads(header), "checks": -1}) + "\n" + "\n".join(rest))
    other = pipeline.audit_paths([root], workers=1, state=state)
    assert other.reused == 0 and "every file is scanned again" in other.dataset["state_note"]


def test_state_lines_it_cannot_read_back_are_scanned_again(tmp_path: Path) -> None:
    """A state line this version cannot read back is scanned again, not trusted, no crash."""
    root = tmp_path / "d"
    for i in range(5):
        hs_file(root / f"g{i}.safetensors", seed=i)
    state = tmp_path / "s.jsonl"
    pipeline.audit_paths([root], workers=1, state=state)
    header, *lines = state.read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    recs[0]["report"]["verdict"] = "weird"
    recs[1]["report"]["colour"] = "blue"
    recs[2]["report"]["layers"][0] = {"aux": 0}
    recs[3]["report"]["verdict"] = "pending"
    state.write_text("\n".join([header, *map(json.dumps, recs)]) + "\n")
    again = pipeline.audit_paths([root], workers=1, state=state)
    assert again.reused == 1 and again.count("ok") == 5


def test_the_store_appends_reads_whole_records_and_rewrites_atomically(tmp_path: Path) -> None:
    """``audit.store``: records in order, torn or non-object lines skipped, atomic rewrites."""
    from vllm_hsfix.audit import store

    path = tmp_path / "j.jsonl"
    assert store.read(path) == []
    store.append(path, {"a": 1})
    store.append(path, {"b": [1, 2]}, sync=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write('[1, 2]\n{"c": ')  # a line that is no object, then a torn one
    assert store.read(path) == [{"a": 1}, {"b": [1, 2]}]
    store.rewrite(path, [{"z": None}])
    assert path.read_text() == '{"z":null}\n' and os.listdir(tmp_path) == ["j.jsonl"]


def test_python_api_is_the_package_surface(tmp_path: Path) -> None:
    """What a generation loop calls: check one file as it is written, audit a set."""
    good = hs_file(tmp_path / "g.safetensors")
    bad = hs_file(tmp_path / "z.safetensors", edit=lambda h, _: h[2].zero_())
    assert audit_api.check_file(good).verdict == "ok"
    rep = audit_api.check_file(bad)
    assert rep.verdict == "corrupt" and rep.codes() == ["zero_rows"]
    report = audit_api.audit_paths([tmp_path], workers=1)
    assert report.regenerate == [str(bad)]


def test_ray_without_ray_installed_says_how_and_exits_2(tmp_path: Path) -> None:
    hs_file(tmp_path / "g.safetensors")
    out = audit_child("without", "ray", "audit", tmp_path, "--ray")
    assert out.returncode == 2, out.stderr
    assert re.fullmatch(
        r"vllm-hsfix audit --ray needs Ray, which is not installed here: "
        r"pip install 'vllm-hsfix\[ray\]'\n",
        out.stderr,
    ), out.stderr
