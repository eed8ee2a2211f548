"""``vllm-hsfix audit``'s command line: reports, exit codes, usage errors, a real process,
and the bounded-memory promise."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from support.hsfiles import A, hs_file, make_mixed
from support.procs import audit_child

from vllm_hsfix.audit import command


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
        ["{tmp}", "--stall-timeout", "-1"],
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
    err = capsys.readouterr().err
    assert err.startswith("vllm-hsfix audit: cannot use ") and err.count("\n") == 1


def test_reference_options_without_reference_warn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hs_file(tmp_path / "good.safetensors")
    assert command.main([str(tmp_path), "--aux-layers", "1,2", "--sample", "3"]) == 0
    err = capsys.readouterr().err
    assert "warning: --aux-layers and --sample ignored: only --reference uses them" in err
    assert command.main([str(tmp_path), "--no-progress"]) == 0
    assert "warning" not in capsys.readouterr().err


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


def test_standalone_process_exit_code_and_progress(tmp_path: Path) -> None:
    """A real process: exit code, progress fit for a log (stderr is a pipe here: plain
    lines with rates, no ``\r`` frames), and no torch/vllm."""
    for i in range(51):
        hs_file(tmp_path / f"f{i:02d}.safetensors", tokens=8, hidden=32, seed=i)
    hs_file(tmp_path / "bad.safetensors", tokens=8, hidden=32, edit=lambda h, i: h[1].zero_())
    out = audit_child("standalone", tmp_path)
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
    out = audit_child("peaks", path)
    assert out.returncode == 0, out.stderr
    base, audited, control, verdict, counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert verdict == "ok" and counts == [tokens] * n_aux
    growth = audited - base
    assert growth < 0.5 * size, f"RSS grew {growth / 1e6:.0f} MB auditing {size / 1e6:.0f} MB"
    assert control - base > 0.8 * size, "the RSS measurement did not see a full mapping"


def test_missing_numpy_is_a_one_line_usage_error_not_corrupt(tmp_path: Path) -> None:
    """On a bare data box without numpy: the install command, exit 2 (1 means corrupt)."""
    hs_file(tmp_path / "f.safetensors", tokens=4, hidden=8)
    out = audit_child("without", "numpy", "audit", tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines == [
        "vllm-hsfix audit needs numpy, which is not installed here: pip install numpy "
        "threadpoolctl tqdm (the package's [audit] extra)"
    ], out.stderr
    assert "Traceback" not in out.stderr
