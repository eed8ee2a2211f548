"""``vllm-hsfix audit``: verdicts, reasons, reports and exit codes on files made to look
like what a broken vLLM writes, plus the bounded-memory promise.

Files are written with ``safetensors.torch.save_file`` (what the connector uses), except
the large one, which is written piecewise through a numpy memmap so the test itself
stays small in memory.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vllm_hsfix.audit import command, parallel, pipeline, reports, scan

ROOT = Path(__file__).resolve().parent.parent
T, A, H = 64, 3, 256


def hs_file(
    path: Path,
    *,
    tokens: int = T,
    n_aux: int = A,
    hidden: int = H,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    scale: float = 1.0,
    edit: object = None,
) -> Path:
    """A connector-like file: random normal rows, random token ids; ``edit(hs, ids)``
    damages them in place before the write."""
    g = torch.Generator().manual_seed(seed)
    hs = (torch.randn(tokens, n_aux, hidden, generator=g) * scale).to(dtype)
    ids = torch.randint(0, 32000, (tokens,), generator=g, dtype=torch.int64)
    if callable(edit):
        edit(hs, ids)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"hidden_states": hs.contiguous(), "token_ids": ids}, str(path))
    return path


def write_raw(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def only(rep: reports.FileReport, code: str) -> reports.Problem:
    """The single problem with ``code`` (fails if there is none or several)."""
    found = [p for p in rep.problems if p.code == code]
    assert len(found) == 1, rep.problems
    return found[0]


# ----------------------------------------------------------------- single files


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_good_file_is_ok_and_described(tmp_path: Path, dtype: torch.dtype) -> None:
    path = hs_file(tmp_path / "good.safetensors", dtype=dtype)
    rep = scan.audit_file(path)
    assert rep.verdict == "ok", rep.problems
    assert rep.problems == []
    assert (rep.n_tokens, rep.n_aux, rep.hidden, rep.n_token_ids) == (T, A, H, T)
    assert rep.dtype == {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}[dtype]
    assert rep.bytes == path.stat().st_size
    assert (rep.zero_rows, rep.nan_count, rep.inf_count, rep.duplicate_rows) == (0, 0, 0, 0)
    assert [st.count for st in rep.layers] == [T] * A
    for st in rep.layers:  # |N(0, I_256)| is about sqrt(256) = 16
        assert st.mean_norm is not None and 15.0 < st.mean_norm < 17.0
        assert st.std_norm is not None and 0.3 < st.std_norm < 1.2


def test_bf16_norms_match_torch(tmp_path: Path) -> None:
    """The numpy bf16 widening must give the same numbers as torch's own conversion."""
    g = torch.Generator().manual_seed(7)
    hs = (torch.randn(T, A, H, generator=g) * torch.linspace(0.1, 30, T)[:, None, None]).to(
        torch.bfloat16
    )
    save_file({"hidden_states": hs, "token_ids": torch.arange(T)}, str(tmp_path / "x.safetensors"))
    rep = scan.audit_file(tmp_path / "x.safetensors")
    norms = hs.float().norm(dim=-1).double()
    for a, st in enumerate(rep.layers):
        assert st.mean_norm == pytest.approx(norms[:, a].mean().item(), rel=1e-5)
        assert st.median_norm == pytest.approx(norms[:, a].quantile(0.5).item(), rel=1e-5)
        assert st.max_norm == pytest.approx(norms[:, a].max().item(), rel=1e-5)
        assert st.min_norm == pytest.approx(norms[:, a].min().item(), rel=1e-5)


def test_zero_rows_are_corrupt(tmp_path: Path) -> None:
    def edit(hs: torch.Tensor, ids: torch.Tensor) -> None:
        hs[5, 1] = 0
        hs[40] = 0  # all three aux rows of one token
        hs[41, 2] = -0.0  # negative zero is zero too

    rep = scan.audit_file(hs_file(tmp_path / "z.safetensors", edit=edit))
    assert rep.verdict == "corrupt"
    assert rep.zero_rows == 5
    assert [st.zero_rows for st in rep.layers] == [1, 2, 2]
    assert [st.count for st in rep.layers] == [T - 1, T - 2, T - 2]
    detail = only(rep, "zero_rows").detail
    assert "5 of 192 rows are all zero" in detail and "first at token position 5" in detail


def test_rows_copied_from_other_tokens_are_suspect(tmp_path: Path) -> None:
    def edit(hs: torch.Tensor, ids: torch.Tensor) -> None:
        ids[:] = torch.arange(T)  # distinct token ids
        hs[20, 0] = hs[3, 0]
        hs[21, 0] = hs[3, 0]
        hs[50, 2] = hs[9, 2]
        hs[51, 1] = hs[51, 2]  # the same token in another layer: not a duplicate

    rep = scan.audit_file(hs_file(tmp_path / "d.safetensors", edit=edit))
    assert rep.verdict == "suspect"
    assert rep.duplicate_rows == 3
    assert [st.duplicate_rows for st in rep.layers] == [2, 0, 1]
    detail = only(rep, "duplicate_rows").detail
    assert "3 rows repeat" in detail and "[3, 20, 21]" in detail


def test_same_token_id_with_the_same_row_is_not_a_duplicate(tmp_path: Path) -> None:
    """An embedding-like layer gives one token id one vector wherever it stands."""

    def edit(hs: torch.Tensor, ids: torch.Tensor) -> None:
        ids[10] = ids[30] = 7
        hs[30, 0] = hs[10, 0]

    rep = scan.audit_file(hs_file(tmp_path / "same.safetensors", edit=edit))
    assert rep.verdict == "ok", rep.problems
    assert rep.duplicate_rows == 0


def test_nan_and_inf_are_corrupt(tmp_path: Path) -> None:
    def edit(hs: torch.Tensor, ids: torch.Tensor) -> None:
        hs[1, 1, 3] = float("nan")
        hs[1, 1, 4] = float("nan")
        hs[2, 2, 2] = float("inf")
        hs[60, 0, 0] = float("-inf")

    rep = scan.audit_file(hs_file(tmp_path / "n.safetensors", edit=edit))
    assert rep.verdict == "corrupt"
    assert (rep.nan_count, rep.inf_count) == (2, 2)
    assert [st.nonfinite_rows for st in rep.layers] == [1, 1, 1]
    assert only(rep, "nonfinite").detail == "2 NaN and 2 Inf values in 3 rows"


def test_underflow_and_overflow_are_not_mistaken_for_zero_or_inf(tmp_path: Path) -> None:
    """Squares of 1e-30 underflow and of 1e30 overflow in float32: neither row is zero
    or non-finite; the tiny one is a near-zero row (suspect)."""

    def edit(hs: torch.Tensor, ids: torch.Tensor) -> None:
        hs[3, 0] = 1e-30
        hs[4, 1] = 1e30

    rep = scan.audit_file(hs_file(tmp_path / "u.safetensors", dtype=torch.float32, edit=edit))
    assert (rep.zero_rows, rep.nan_count, rep.inf_count) == (0, 0, 0)
    assert rep.near_zero_rows == 1 and rep.layers[0].near_zero_rows == 1
    assert rep.layers[0].min_norm == pytest.approx(1e-30 * 16, rel=1e-5)
    assert rep.layers[1].max_norm == pytest.approx(1e30 * 16, rel=1e-5)
    assert rep.verdict == "suspect"
    assert rep.codes() == ["near_zero_rows"]


def test_token_count_mismatch_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    hs = torch.randn(T, A, H).to(torch.bfloat16)
    save_file({"hidden_states": hs, "token_ids": torch.arange(T - 3)}, str(path))
    rep = scan.audit_file(path)
    assert rep.verdict == "corrupt" and rep.token_mismatch is True
    assert only(rep, "token_mismatch").detail == f"{T - 3} token_ids for {T} hidden-state tokens"
    assert [st.count for st in rep.layers] == [T] * A  # the rows are still audited


@pytest.mark.parametrize(
    ("tensors", "code", "needle"),
    [
        # Unknown layouts and dtypes are "unsupported", not corrupt: test_audit_fp8.py.
        ({"hidden_states": torch.ones(4, 3, 8)}, "missing_key", "['token_ids']"),
        (
            {"hidden_states": torch.ones(4, 24), "token_ids": torch.arange(4)},
            "bad_shape",
            "expected 3-D",
        ),
        (
            {"hidden_states": torch.ones(0, 3, 8), "token_ids": torch.arange(0)},
            "empty",
            "shape [0, 3, 8]",
        ),
        (
            {"hidden_states": torch.ones(4, 0, 8), "token_ids": torch.arange(4)},
            "empty",
            "shape [4, 0, 8]",
        ),
    ],
)
def test_wrong_keys_dtypes_shapes_and_empty_are_corrupt(
    tmp_path: Path, tensors: dict[str, torch.Tensor], code: str, needle: str
) -> None:
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    rep = scan.audit_file(path)
    assert rep.verdict == "corrupt"
    assert code in rep.codes()
    assert needle in only(rep, code).detail


def test_extra_tensor_is_suspect(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    hs = torch.randn(T, A, H)
    save_file(
        {"hidden_states": hs, "token_ids": torch.arange(T), "extra": hs[0].clone()}, str(path)
    )
    rep = scan.audit_file(path)
    assert rep.verdict == "suspect" and rep.codes() == ["extra_keys"]


def test_truncated_files_are_corrupt(tmp_path: Path) -> None:
    good = hs_file(tmp_path / "src.safetensors").read_bytes()
    cut_data = write_raw(tmp_path / "a.safetensors", good[:-1000])
    rep = scan.audit_file(cut_data)
    assert rep.verdict == "corrupt" and rep.codes() == ["truncated"]
    assert "(1000 missing)" in rep.problems[0].detail
    assert (rep.n_tokens, rep.n_aux, rep.hidden) == (T, A, H)  # the header still speaks
    assert rep.layers == []

    cut_header = write_raw(tmp_path / "b.safetensors", good[:40])
    rep = scan.audit_file(cut_header)
    assert rep.codes() == ["truncated"] and "inside the header" in rep.problems[0].detail

    write_raw(tmp_path / "c.safetensors.lock", b"")  # the writer may still be at it
    rep = scan.audit_file(write_raw(tmp_path / "c.safetensors", good[:-10]))
    assert rep.codes() == ["truncated"] and "writer may still be running" in rep.reason()


def test_trailing_bytes_and_bad_offsets_are_corrupt(tmp_path: Path) -> None:
    good = hs_file(tmp_path / "src.safetensors").read_bytes()
    rep = scan.audit_file(write_raw(tmp_path / "t.safetensors", good + b"\0" * 16))
    assert rep.verdict == "corrupt" and rep.codes() == ["trailing_bytes"]

    n = int.from_bytes(good[:8], "little")
    header = json.loads(good[8 : 8 + n])
    header["token_ids"]["data_offsets"][1] += 8  # does not match its shape any more
    raw = json.dumps(header).encode()
    bad = len(raw).to_bytes(8, "little") + raw + good[8 + n :]
    rep = scan.audit_file(write_raw(tmp_path / "o.safetensors", bad))
    assert rep.codes() == ["bad_header"] and "needs 512 bytes" in rep.reason()


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"", "only 0 bytes"),
        (b"abc", "only 3 bytes"),
        (b"this is a text file, not tensors\n" * 20, "header length"),
        (bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)), "header length"),
        ((20).to_bytes(8, "little") + b"[1, 2, 3]" + b" " * 11, "not a JSON object"),
        ((20).to_bytes(8, "little") + b"\xff" * 20, "not JSON"),
    ],
)
def test_non_safetensors_files_are_corrupt_not_crashes(
    tmp_path: Path, data: bytes, needle: str
) -> None:
    rep = scan.audit_file(write_raw(tmp_path / "junk.safetensors", data))
    assert rep.verdict == "corrupt"
    assert rep.codes() == ["not_safetensors"]
    assert needle in rep.problems[0].detail


def test_unreadable_path_is_corrupt(tmp_path: Path) -> None:
    link = tmp_path / "gone.safetensors"
    link.symlink_to(tmp_path / "missing-target")
    rep = scan.audit_file(link)
    assert rep.verdict == "corrupt" and rep.codes() == ["unreadable"]
    assert "No such file" in rep.reason()


def test_small_windows_give_the_same_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Findings must not depend on where the window and block edges fall."""

    def edit(hs: torch.Tensor, ids: torch.Tensor) -> None:
        ids[:] = torch.arange(len(ids))
        hs[7, 1] = 0
        hs[250, 2] = 0
        hs[299, 0] = hs[1, 0]  # copied across many windows
        hs[123, 2, 5] = float("nan")

    path = hs_file(tmp_path / "w.safetensors", tokens=300, hidden=96, edit=edit)
    default = scan.audit_file(path)
    monkeypatch.setattr(scan, "CHUNK_BYTES", 96 * 2 * 3 * 7)  # 7 tokens per window
    monkeypatch.setattr(scan, "BLOCK_BYTES", 96 * 4 * 5)  # 5 rows per block
    small = scan.audit_file(path)
    assert default.verdict == small.verdict == "corrupt"
    assert (small.zero_rows, small.duplicate_rows, small.nan_count) == (2, 1, 1)
    for a, b in zip(default.layers, small.layers, strict=True):
        assert a.count == b.count and a.mean_norm == pytest.approx(b.mean_norm, rel=1e-12)
    assert default.codes() == small.codes() == ["zero_rows", "nonfinite", "duplicate_rows"]


# ----------------------------------------------------------------- datasets


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
    # A heuristic's verdict is "look", never "regenerate" (issue 20).
    assert report.suspect == [str(off)] and report.regenerate == []
    refs = report.dataset["norm_reference"]
    assert [r["aux"] for r in refs] == [0, 1, 2]
    assert all(15 < r["median"] < 17 and r["files"] == 12 for r in refs)


def test_norm_pass_uses_medians_so_one_big_row_is_fine(tmp_path: Path) -> None:
    """Attention-sink tokens carry norms ~100x the rest; a short file with one must not
    look like a dataset outlier."""
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


_REAL_AUDIT_FILE = scan.audit_file


def _dies_on_boom(path: str) -> reports.FileReport:
    """Stands in for a worker killed mid-file (SIGBUS on a file shrunk under its map)."""
    if "boom" in os.fspath(path):
        os._exit(3)
    return _REAL_AUDIT_FILE(path)


def _always_dies(path: str) -> reports.FileReport:
    os._exit(3)


def test_a_worker_crash_is_pinned_on_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(3):
        hs_file(tmp_path / f"g{i}.safetensors", seed=i)
    boom = hs_file(tmp_path / "boom.safetensors", seed=9)
    monkeypatch.setattr(parallel, "audit_file", _dies_on_boom)
    report = pipeline.audit_paths([tmp_path], workers=2)
    by = {f.path: f for f in report.files}
    assert by[str(boom)].verdict == "corrupt" and by[str(boom)].codes() == ["unreadable"]
    assert "worker died" in by[str(boom)].reason()
    assert by[str(boom)].bytes == boom.stat().st_size
    assert [f.verdict for p, f in by.items() if p != str(boom)] == ["ok"] * 3


def test_workers_that_cannot_run_are_not_blamed_on_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hs_file(tmp_path / "g.safetensors")
    monkeypatch.setattr(parallel, "audit_file", _always_dies)
    with pytest.raises(RuntimeError, match="cannot run"):
        pipeline.audit_paths([tmp_path], workers=1)
    assert command.main([str(tmp_path)]) == 2
    assert "cannot run" in capsys.readouterr().err


# ----------------------------------------------------------------- CLI


def make_mixed(root: Path) -> dict[str, Path]:
    """4 good, 1 corrupt (zero rows), 1 suspect (duplicates), 1 not safetensors."""
    out = {f"good{i}": hs_file(root / f"good{i}.safetensors", seed=i) for i in range(4)}

    def dup(hs: torch.Tensor, ids: torch.Tensor) -> None:
        ids[:] = torch.arange(len(ids))
        hs[9, 1] = hs[2, 1]

    out["zero"] = hs_file(root / "zero.safetensors", seed=10, edit=lambda h, i: h[3, 0].zero_())
    out["dup"] = hs_file(root / "dup.safetensors", seed=11, edit=dup)
    out["junk"] = write_raw(root / "junk.safetensors", b"not tensors at all" * 10)
    return out


def test_cli_json_report_and_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = make_mixed(tmp_path)
    code = command.main([str(tmp_path), "--json", "--workers", "2"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1
    assert doc["totals"]["files"] == 7
    assert (doc["totals"]["ok"], doc["totals"]["suspect"], doc["totals"]["corrupt"]) == (4, 1, 2)
    assert doc["totals"]["bytes"] == sum(p.stat().st_size for p in files.values())
    assert doc["totals"]["workers"] == 2 and doc["totals"]["gb_per_s"] > 0
    assert doc["schema"] == 3
    assert sorted(doc["regenerate"]) == sorted(str(files[k]) for k in ("zero", "junk"))
    assert doc["suspect"] == [str(files["dup"])] and doc["pending"] == []
    verdicts = {Path(f["path"]).stem: f["verdict"] for f in doc["files"]}
    assert verdicts["zero"] == "corrupt" and verdicts["dup"] == "suspect"
    zero = next(f for f in doc["files"] if f["path"] == str(files["zero"]))
    assert zero["problems"][0]["code"] == "zero_rows" and zero["zero_rows"] == 1
    assert len(zero["layers"]) == A and zero["layers"][0]["zero_rows"] == 1


def test_cli_human_output_and_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = make_mixed(tmp_path / "data")
    out_csv = tmp_path / "report.csv"
    code = command.main([str(tmp_path / "data"), "--csv", str(out_csv)])
    text = capsys.readouterr().out
    assert code == 1
    assert "ok 4   suspect 1   corrupt 2" in text
    assert "zero_rows (corrupt): 1 file\n" in text
    assert f"  {files['zero']}: 1 of 192 rows are all zero" in text
    assert f"duplicate_rows (suspect): 1 file\n  {files['dup']}: " in text
    assert str(files["good0"]) not in text  # ok files are not listed
    rows = list(csv.DictReader(out_csv.open()))
    assert len(rows) == 7
    by = {Path(r["path"]).stem: r for r in rows}
    assert by["zero"]["verdict"] == "corrupt" and by["zero"]["zero_rows"] == "1"
    assert by["dup"]["codes"] == "duplicate_rows" and by["good1"]["verdict"] == "ok"
    assert by["junk"]["codes"] == "not_safetensors"


def test_suspect_only_exits_zero_but_is_listed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_mixed(tmp_path)
    (tmp_path / "zero.safetensors").unlink()
    (tmp_path / "junk.safetensors").unlink()
    assert command.main([str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["regenerate"] == [] and doc["suspect"] == [str(tmp_path / "dup.safetensors")]
    (tmp_path / "dup.safetensors").unlink()
    assert command.main([str(tmp_path)]) == 0
    assert "result: all files ok" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["{tmp}/does-not-exist"],
        ["{tmp}", "--workers", "0"],
        ["{tmp}/empty-dir"],
        ["{tmp}", "--json", "--jsonl", "-"],
        ["{tmp}", "--json", "--list", "corrupt", "-"],
        ["{tmp}", "--list", "broken", "{tmp}/x"],
        ["{tmp}", "--show", "-1"],
        ["{tmp}", "--jsonl", "{tmp}/no/dir/x.jsonl"],
        [],
    ],
)
def test_usage_errors_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    hs_file(tmp_path / "good.safetensors")
    (tmp_path / "empty-dir").mkdir()
    assert command.main([a.format(tmp=tmp_path) for a in argv]) == 2
    assert capsys.readouterr().err.strip() != ""


def test_unwritable_csv_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hs_file(tmp_path / "good.safetensors")
    assert command.main([str(tmp_path), "--csv", str(tmp_path / "no" / "dir" / "r.csv")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_add_parser_wires_into_a_cli(tmp_path: Path) -> None:
    """What ``vllm_hsfix.cli`` does: a subcommand whose ``fn(args)`` is the exit code."""
    import argparse

    hs_file(tmp_path / "z.safetensors", edit=lambda hs, ids: hs[0].zero_())
    ap = argparse.ArgumentParser(prog="vllm-hsfix")
    sub = ap.add_subparsers(dest="cmd", required=True)
    command.add_parser(sub)
    args = ap.parse_args(["audit", str(tmp_path), "--workers", "1"])
    assert args.fn is command.run and args.json is False and args.csv is None
    assert args.fn(args) == 1


def run_py(code: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter; output decoded by hand so ``\r`` survives."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )
    return subprocess.CompletedProcess(
        out.args, out.returncode, out.stdout.decode(), out.stderr.decode()
    )


def test_standalone_process_exit_code_and_progress(tmp_path: Path) -> None:
    """A real process: exit code, progress fit for a log (stderr is a pipe here: plain
    lines with rates, no ``\r`` frames), and no torch/vllm."""
    for i in range(51):
        hs_file(tmp_path / f"f{i:02d}.safetensors", tokens=8, hidden=32, seed=i)
    hs_file(tmp_path / "bad.safetensors", tokens=8, hidden=32, edit=lambda h, i: h[1].zero_())
    out = run_py(
        f"""
        import json, sys
        from vllm_hsfix.audit.command import main
        light = "numpy" not in sys.modules
        code = main([{str(tmp_path)!r}, "--workers", "2"])
        heavy = sorted(m for m in ("torch", "vllm", "safetensors") if m in sys.modules)
        print(json.dumps([code, light, heavy]))
        """
    )
    assert out.returncode == 0, out.stderr
    code, light, heavy = json.loads(out.stdout.strip().splitlines()[-1])
    assert code == 1
    assert light is True, "importing vllm_hsfix.audit must not import numpy"
    assert heavy == []
    assert "\r" not in out.stderr
    lines = out.stderr.splitlines()
    for label in ("scan", "norms", "prefix"):
        done = [x for x in lines if x.startswith(f"audit {label}: 52/52 files, ")]
        assert len(done) == 1 and "files/s" in done[0], out.stderr
    scan_line = next(x for x in lines if x.startswith("audit scan:"))
    assert re.search(r"\d+\.\d+ GB/s$", scan_line), scan_line
    assert "zero_rows (corrupt): 1 file" in out.stdout
    assert "ok 51   suspect 0   corrupt 1" in out.stdout


# ----------------------------------------------------------------- bounded memory


def write_big_bf16(path: Path, tokens: int, n_aux: int, hidden: int) -> int:
    """A valid safetensors file written piecewise through a memmap (never all in RAM)."""
    n_hs = tokens * n_aux * hidden * 2
    header = {
        "hidden_states": {"dtype": "BF16", "shape": [tokens, n_aux, hidden],
                          "data_offsets": [0, n_hs]},
        "token_ids": {"dtype": "I64", "shape": [tokens], "data_offsets": [n_hs, n_hs + 8 * tokens]},
    }  # fmt: skip
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    size = start + n_hs + 8 * tokens
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(size)
    rng = np.random.default_rng(0)
    hs = np.memmap(path, dtype="<u2", mode="r+", offset=start, shape=(tokens, n_aux, hidden))
    step = 1024
    for t in range(0, tokens, step):
        block = rng.standard_normal((min(step, tokens - t), n_aux, hidden), dtype=np.float32)
        hs[t : t + step] = (block.view(np.uint32) >> 16).astype(np.uint16)
        hs.flush()
    del hs
    ids = np.memmap(path, dtype="<i8", mode="r+", offset=start + n_hs, shape=(tokens,))
    ids[:] = np.arange(tokens)
    ids.flush()
    del ids
    return size


def test_memory_stays_bounded_on_a_200mb_file(tmp_path: Path) -> None:
    path = tmp_path / "big.safetensors"
    tokens, n_aux, hidden = 16384, 3, 2048
    size = write_big_bf16(path, tokens, n_aux, hidden)
    assert size > 200_000_000
    with safe_open(str(path), framework="numpy") as f:  # the hand-written file is valid
        assert f.get_slice("hidden_states").get_shape() == [tokens, n_aux, hidden]
    out = run_py(
        f"""
        import json, resource
        import numpy as np
        from vllm_hsfix.audit.scan import audit_file

        def peak():
            # Peak RSS of this process. On Linux getrusage's ru_maxrss also carries the
            # peak of the process that forked us (pytest, with torch loaded) across
            # exec, so the per-address-space VmHWM is read where it exists.
            try:
                with open("/proc/self/status") as f:
                    line = next(x for x in f if x.startswith("VmHWM:"))
                return int(line.split()[1]) * 1024
            except OSError:
                return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

        base = peak()
        rep = audit_file({str(path)!r})
        audited = peak()
        # Control: the same measurement does see a whole-file mapping being read.
        mm = np.memmap({str(path)!r}, dtype=np.uint8, mode="r")
        int(mm[::4096].sum())
        control = peak()
        print(json.dumps([base, audited, control, rep.verdict, [s.count for s in rep.layers]]))
        """
    )
    assert out.returncode == 0, out.stderr
    base, audited, control, verdict, counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert verdict == "ok" and counts == [tokens] * n_aux
    growth = audited - base
    assert growth < 0.5 * size, f"RSS grew {growth / 1e6:.0f} MB auditing {size / 1e6:.0f} MB"
    assert control - base > 0.8 * size, "the RSS measurement did not see a full mapping"


def test_missing_numpy_is_a_one_line_usage_error_not_corrupt(tmp_path: Path) -> None:
    """On a bare data box without numpy: the install command, exit 2 (1 means corrupt)."""
    hs_file(tmp_path / "f.safetensors", tokens=4, hidden=8)
    out = run_py(
        f"""
        import sys
        sys.modules["numpy"] = None  # as if numpy were not installed
        from vllm_hsfix.cli import main
        sys.exit(main(["audit", {str(tmp_path)!r}]))
        """
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines == [
        "vllm-hsfix audit needs numpy, which is not installed here: pip install 'vllm-hsfix[audit]'"
    ], out.stderr
    assert "Traceback" not in out.stderr
