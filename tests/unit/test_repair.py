"""``vllm-hsfix repair`` without an engine: targets, the atomic replacement, the journal,
the guard (real ``vllm-hsfix status``), usage errors, ``--dry-run``, the final report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from conftest import clean_env
from safetensors.torch import load_file, save_file
from support.commands import repair
from support.digest import digest
from support.hsfiles import H, hs_file, write_raw

from vllm_hsfix.repair import command, files, guard

pytestmark = pytest.mark.needs_vllm


def zero_row(h: object, _: object) -> None:
    h[1].zero_()  # type: ignore[index]


def test_a_target_keeps_its_token_ids_dtype_and_shape_or_says_why_not(tmp_path: Path) -> None:
    f = hs_file(tmp_path / "a.safetensors", tokens=12, seed=3, edit=zero_row)
    t = files.read_target(str(f))
    assert t.problem is None and t.token_ids == load_file(str(f))["token_ids"].tolist()
    assert (t.dtype, t.n_aux, t.hidden) == ("BF16", 3, H)
    junk = write_raw(tmp_path / "junk.safetensors", b"not tensors at all" * 10)
    cut = write_raw(tmp_path / "cut.safetensors", f.read_bytes()[:200])
    for bad in (junk, cut):
        assert files.read_target(str(bad)).problem.startswith("token ids unreadable")


def test_targets_from_an_audits_jsonl_or_list_and_shards(tmp_path: Path) -> None:
    recs = [
        {"type": "file", "path": "/d/a", "verdict": "ok"},
        {"type": "file", "path": "/d/b", "verdict": "corrupt"},
        {"type": "file", "path": "/d/c", "verdict": "suspect"},
        {"type": "update", "path": "/d/a", "verdict": "corrupt", "problems": []},
        {"type": "summary"},
    ]
    jl = tmp_path / "a.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"type": "file", "pa')
    assert sorted(files.from_audit_output(str(jl), False)) == ["/d/a", "/d/b"]
    assert sorted(files.from_audit_output(str(jl), True)) == ["/d/a", "/d/b", "/d/c"]
    (tmp_path / "corrupt.txt").write_text("/d/x.safetensors\n/d/y.safetensors\n")
    listed = files.from_audit_output(str(tmp_path / "corrupt.txt"), False)
    assert listed == ["/d/x.safetensors", "/d/y.safetensors"]
    paths = [f"/p/{i}" for i in range(7)]
    parts = [command.shard(paths, command.parse_shard(f"{k}/3")) for k in range(3)]
    assert sorted(p for part in parts for p in part) == sorted(paths) and all(parts)
    for bad in ("3/3", "x", "1/"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected K/N"):
            command.parse_shard(bad)


@pytest.mark.parametrize("change", [None, "token_ids", "dtype", "n_aux"])
def test_install_replaces_atomically_with_a_backup_or_refuses_a_misfit(
    tmp_path: Path, change: str | None
) -> None:
    """The "regenerated" file: the same token ids, other rows (what vLLM would write);
    one that does not fit the old file's form is refused and the old file stays."""
    import torch

    old = hs_file(tmp_path / "d" / "sub" / "x.safetensors", tokens=10, seed=1, edit=zero_row)
    before = old.read_bytes()
    t = files.read_target(str(old))
    ids = load_file(str(old))["token_ids"]
    hs = torch.randn(10, 3, H).to(torch.bfloat16)
    if change == "token_ids":
        ids[0] += 1
    hs = hs.float() if change == "dtype" else hs[:, :2].contiguous() if change == "n_aux" else hs
    new = tmp_path / "req-1.safetensors"
    save_file({"hidden_states": hs, "token_ids": ids}, str(new))
    if change:
        with pytest.raises(files.Refused):
            files.check_new(files.read_target(str(new)), t)
        assert old.read_bytes() == before
        return
    files.check_new(files.read_target(str(new)), t)
    sha, size = files.install(str(new), t, str(tmp_path / "bak"), str(tmp_path / "d"))
    assert old.read_bytes() == new.read_bytes()
    assert (sha, size) == (digest(old), old.stat().st_size)
    assert (tmp_path / "bak" / "sub" / "x.safetensors").read_bytes() == before
    assert [p.name for p in old.parent.iterdir()] == ["x.safetensors"]  # no temp file left


def test_the_journal_says_done_only_for_an_unchanged_replaced_file(tmp_path: Path) -> None:
    f = hs_file(tmp_path / "x.safetensors", seed=1)
    state = tmp_path / "state.jsonl"
    files.Journal(str(state)).record(str(f), "replaced", (digest(f), f.stat().st_size))
    with state.open("a") as out:
        out.write('{"path": "/cut sh')  # a killed run's last line
    again = files.Journal(str(state))
    assert again.is_done(str(f)) and again.count("replaced") == 1
    hs_file(f, seed=2)  # written again since
    assert not again.is_done(str(f))


def test_usage_errors_exit_2_and_write_nothing(tmp_path: Path) -> None:
    files_ = bad_dataset(tmp_path / "d")
    before = {k: digest(p) for k, p in files_.items()}
    m = model_dir(tmp_path)
    for argv, message in [
        (["{d}", "--model", "{tmp}/nope"], "no config.json there (missing model)"),
        (["{d}"], "--model MODEL_DIR is required (unless --dry-run or --endpoint)"),
        (["{tmp}/missing", "--model", "{m}"], "no such file or directory"),
        (["{d}", "--model", "{m}", "--shard", "2/2"], "expected K/N"),
        (["{d}", "--model", "{m}", "--engine-arg", "dtype"], "expected KEY=VALUE"),
        (["{d}", "--model", "{m}", "--batch-size", "0"], "must be an integer >= 1"),
        (["{d}", "--model", "{m}", "--aux-layers", "1,x"], "expected integers"),
        (["{d}", "--model", "{m}"], "the aux layers are not known: pass --aux-layers"),
    ]:
        out = repair(*(a.format(d=tmp_path / "d", tmp=tmp_path, m=m) for a in argv))
        assert out.returncode == 2 and message in out.stderr, (argv, out.stderr)
    assert {k: digest(p) for k, p in files_.items()} == before


def model_dir(tmp_path: Path) -> Path:
    """A model to the usage check (the guard stops these runs before vLLM loads it)."""
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")
    return tmp_path / "model"


def bad_dataset(root: Path) -> dict[str, Path]:
    out = {f"good{i}": hs_file(root / f"good{i}.safetensors", seed=i) for i in range(4)}
    out["zero"] = hs_file(root / "zero.safetensors", seed=10, tokens=20, edit=zero_row)
    out["zero2"] = hs_file(root / "zero2.safetensors", seed=11, tokens=30, edit=zero_row)
    return out


def test_dry_run_lists_the_corrupt_files_and_a_clean_dataset_starts_no_engine(
    tmp_path: Path,
) -> None:
    found = bad_dataset(tmp_path / "d")
    out = repair(str(tmp_path / "d"), "--dry-run", "--aux-layers", "1,2,3", "--no-progress")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:2] == [f"{found['zero']}\t20 tokens", f"{found['zero2']}\t30 tokens"]
    assert lines[-1] == "would regenerate 2 files, 50 tokens"
    for i in range(4):
        hs_file(tmp_path / "clean" / f"g{i}.safetensors", seed=i)
    out = repair(str(tmp_path / "clean"), "--model", str(model_dir(tmp_path)), "--no-progress",
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
    found = bad_dataset(tmp_path / "d")
    before = {k: digest(p) for k, p in found.items()}
    state = tmp_path / "s.jsonl"
    out = repair(
        str(tmp_path / "d"), "--model", str(model_dir(tmp_path)), "--aux-layers", "1,2,3",
        "--no-progress", "--state", str(state),
        env=clean_env(VLLM_CPU_KVCACHE_SPACE=None, **switch),
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "the fix is not active here; nothing written" in out.stderr
    assert "engine ready" not in out.stderr and not state.exists()
    assert {k: digest(p) for k, p in found.items()} == before


def test_a_regenerated_file_the_audit_calls_suspect_is_named_but_does_not_fail(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A regenerated file the re-audit calls suspect is named, exit 0; a corrupt one fails."""
    from vllm_hsfix import cli

    parsed = cli.build_parser().parse_args(["repair", "x", "--model", "m", "--dry-run"])
    assert parsed.fn is command.run and parsed.dry_run and parsed.batch_size == 256
    d = tmp_path / "d"
    for i in range(10):
        hs_file(d / f"g{i:02d}.safetensors", seed=i)
    odd = hs_file(d / "odd.safetensors", seed=40, scale=1000.0)
    args = argparse.Namespace(paths=[str(d)], from_audit=None, workers=1, no_progress=True)
    fates = files.Fates({str(odd): ("replaced", ("", 0))})
    assert command.finish(args, [str(odd)], fates, str(tmp_path / "s.audit")) == 0
    out = capsys.readouterr().out
    assert f"regenerated, the audit calls it suspect {odd}: norm_outlier: " in out, out
    assert "result: every targeted file is ok (1 regenerated files the audit calls" in out
    hs_file(odd, seed=40, edit=zero_row)  # the same file corrupt after regeneration
    assert command.finish(args, [str(odd)], fates, str(tmp_path / "s2.audit")) == 1
    assert f"still bad {odd}: audit says corrupt after regeneration" in capsys.readouterr().out


def _status(where: Path, pid: int, role: str, patches: dict[str, str]) -> None:
    body = {"pid": pid, "role": role, "patches": {k: {"status": v} for k, v in patches.items()}}
    (where / f"{pid}.json").write_text(json.dumps(body))


@pytest.mark.parametrize(
    "seen, problem", [("on-import", False), ("applied", False), ("refused", True)]
)
def test_the_guard_lets_a_model_family_row_stay_on_import_and_no_other(
    tmp_path: Path, seen: str, problem: bool
) -> None:
    """A model-family row (``aux-final-layer``) may stay on-import for another family's
    verifier; refused it stops the repair, and a row of every model must be applied."""
    _status(tmp_path, 11, "engine-core", {"aux-final-layer": seen, "scatter-clamp": "applied"})
    _status(tmp_path, 12, "worker-0", {"aux-final-layer": seen, "scatter-clamp": "on-import"})
    got = guard.in_engine(str(tmp_path), ["aux-final-layer", "scatter-clamp"])
    assert bool([p for p in got if "aux-final-layer" in p]) is problem, got
    _status(tmp_path, 11, "engine-core", {"scatter-clamp": "on-import"})
    assert any("scatter-clamp" in p for p in guard.in_engine(str(tmp_path), ["scatter-clamp"]))
