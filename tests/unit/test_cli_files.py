"""Nothing of the user's is overwritten or left behind: every path a subcommand reads or
writes, given a user's text file, a binary file, a directory, a path that cannot be
written or does not exist, or a stdout closed early. Each case: the exit code, one line
on stderr, the user's file byte for byte, and nothing new in the working directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_env
from support.commands import cli
from support.hsfiles import hs_file

USER_TEXT = b"my notes: do not lose these\nline two\n"
USER_BINARY = bytes(range(256)) * 4


def layout(tmp: Path) -> dict[str, str]:
    """A dataset (one corrupt file among good ones) and the user's files beside it."""
    for i in range(3):
        hs_file(tmp / "data" / f"good{i}.safetensors", seed=i)
    hs_file(tmp / "data" / "zero.safetensors", seed=9, edit=lambda h, i: h[3, 0].zero_())
    (tmp / "notes.txt").write_bytes(USER_TEXT)
    (tmp / "blob.bin").write_bytes(USER_BINARY)
    (tmp / "folder").mkdir()
    (tmp / "cwd").mkdir()
    return {
        "DATA": str(tmp / "data"),
        "TEXT": str(tmp / "notes.txt"),
        "BINARY": str(tmp / "blob.bin"),
        "DIR": str(tmp / "folder"),
        "UNWRITABLE": str(tmp / "notes.txt" / "out"),  # below a file: even root cannot
        "MISSING": str(tmp / "no-such-file"),
    }


AUDIT = ["audit", "DATA", "--no-progress"]
REPAIR = ["repair", "DATA", "--dry-run", "--no-progress"]
BAD_OUTPUTS = ["TEXT", "BINARY", "DIR", "UNWRITABLE"]
CASES = {
    **{f"audit-state-{b}": [*AUDIT, "--state", b] for b in BAD_OUTPUTS},
    **{f"audit-list-{b}": [*AUDIT, "--list", "corrupt", b] for b in BAD_OUTPUTS},
    **{f"audit-csv-{b}": [*AUDIT, "--csv", b] for b in BAD_OUTPUTS},
    **{f"audit-jsonl-{b}": [*AUDIT, "--jsonl", b] for b in BAD_OUTPUTS},
    "audit-input-missing": ["audit", "MISSING", "--no-progress"],
    **{f"repair-state-{b}": [*REPAIR, "--aux-layers", "1,2,3", "--state", b] for b in BAD_OUTPUTS},
    **{
        f"repair-from-audit-{b}": [*REPAIR, "--aux-layers", "1,2,3", "--from-audit", b]
        for b in ["TEXT", "BINARY", "DIR", "MISSING"]
    },
    "repair-backup-TEXT": [*REPAIR, "--aux-layers", "1,2,3", "--backup", "TEXT"],
    "repair-input-missing": ["repair", "MISSING", "--dry-run"],
    "repair-no-model": ["repair", "DATA", "--aux-layers", "1,2,3"],
    # Stops on its usage after the audit: the audit state it began is not left behind.
    "repair-no-aux-layers": REPAIR,
}


def fill(args: list[str], paths: dict[str, str]) -> list[str]:
    return [paths.get(a, a) for a in args]


def snapshot(tmp: Path) -> dict[str, bytes | None]:
    """Every file under ``tmp`` (a directory: None)."""
    return {
        str(p.relative_to(tmp)): None if p.is_dir() else p.read_bytes()
        for p in sorted(tmp.rglob("*"))
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_path_is_one_line_exit_2_and_nothing_changes(tmp_path: Path, case: str) -> None:
    paths = layout(tmp_path)
    before = snapshot(tmp_path)
    out = cli(*fill(CASES[case], paths), cwd=str(tmp_path / "cwd"))
    lines = out.stderr.strip().splitlines()
    assert (out.returncode, len(lines)) == (2, 1), out.stderr[-3000:]
    assert lines[0].startswith("vllm-hsfix ") and "Traceback" not in out.stderr
    assert snapshot(tmp_path) == before


def test_a_user_file_is_named_and_kept(tmp_path: Path) -> None:
    paths = layout(tmp_path)
    out = cli(*AUDIT[:1], paths["DATA"], "--state", paths["TEXT"], "--no-progress")
    assert out.returncode == 2 and "is not an audit state file" in out.stderr
    assert Path(paths["TEXT"]).read_bytes() == USER_TEXT


def test_its_own_files_are_written_again_whole(tmp_path: Path) -> None:
    """The same outputs twice: the second run takes its own files and leaves no
    temporary file beside them."""
    paths = layout(tmp_path)
    outs = ["--state", "s", "--list", "bad", "l", "--csv", "c", "--jsonl", "j"]
    for _ in range(2):
        out = cli("audit", paths["DATA"], "--no-progress", *outs, cwd=str(tmp_path / "cwd"))
        assert out.returncode == 1, out.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "cwd")) == ["c", "j", "l", "s"]
    assert (tmp_path / "cwd" / "l").read_text().endswith("zero.safetensors\n")


COMMANDS = {
    "status": ["status", "--json"],
    "bootstrap-dir": ["bootstrap-dir"],
    "audit": ["audit", "DATA", "--no-progress", "--list", "corrupt", "-"],
    "audit-jsonl": ["audit", "DATA", "--no-progress", "--jsonl", "-"],
    "repair": [*REPAIR, "--aux-layers", "1,2,3"],
}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_pipe_closed_early_ends_quietly(tmp_path: Path, name: str) -> None:
    """``vllm-hsfix ... | head -0``: no traceback, and not an exit code that means
    something else (1: corrupt files; 2: usage)."""
    paths = layout(tmp_path)
    cmd = [sys.executable, "-m", "vllm_hsfix", *fill(COMMANDS[name], paths)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=clean_env(),
        cwd=tmp_path / "cwd",
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141, err[-3000:]
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception" not in err
