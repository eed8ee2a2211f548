"""Hazards on the real vLLM engine (tiny dense Qwen3, in-process engine): an abort before
scheduling (``support/children/abort_case.py``: the release raises ``KeyError``, the
patch saves the others right, its connector half alone moves the crash to the
scheduler), and prefix caching (``support/children/prefix_case.py``: the register's
claims for the installed release against the files it writes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import INSTALL, RELEASE, clean_env
from support.abort import AUX_IDS, PROMPT_LEN, compare_files, model_dir, prompts, right
from support.procs import marked_json, run_child

from vllm_hsfix import hazards

pytestmark = [pytest.mark.e2e, pytest.mark.needs_vllm]


def run_script(
    script: str, args: dict[str, Any], work: Path, marker: str, **env_: str
) -> dict[str, Any]:
    """Run ``tests/support/children/<script>`` with ``args`` in a fresh interpreter
    (in-process engine); return the JSON it prints after ``marker``."""
    env = clean_env(VLLM_ENABLE_V1_MULTIPROCESSING="0", **env_)
    proc = run_child(script, args, work, env=env, timeout=900)
    result: dict[str, Any] = marked_json(proc, marker + " ")
    print(f"vLLM {INSTALL.version}: {json.dumps(result, indent=1)[:6000]}")
    return result


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("abort")
    args = {
        "model": str(model_dir()),
        "aux_ids": AUX_IDS,
        "out": str(work / "hs"),
        "prompts": prompts(),
        "half": True,
    }
    return run_script("abort_case.py", args, work, "HSFIX_ABORT_RESULT")


@pytest.mark.applies("abort-before-scheduling")
def test_release_raises_keyerror_on_abort_before_scheduling(run: dict[str, Any]) -> None:
    """Failing first: the release's own connector, no patch in place."""
    assert run["patches"]["abort-before-scheduling"] == "applied", run["patches"]
    a = run["rounds"]["release"]
    assert not any(a["live"].values()), a["live"]  # the release's own methods ran
    err = a["abort_error"]
    assert err is not None, f"the release did not crash: {a}"
    assert err["type"] == "KeyError" and err["function"] == "request_finished", err
    assert "finish_requests" in err["functions"], err


@pytest.mark.applies("abort-before-scheduling")
def test_patched_engine_survives_and_saves_the_other_requests(run: dict[str, Any]) -> None:
    b = run["rounds"]["patched"]
    assert all(b["live"].values()), b["live"]
    assert b["abort_error"] is None and b["step_error"] is None, b
    p = prompts()
    report = compare_files(b["paths"], {"b-r0": p[0], "b-r1": p[1]})
    print(report)
    for rid, r in report.items():
        assert r["shape"][:2] == (PROMPT_LEN, len(AUX_IDS)), (rid, r)
        assert right(r), (rid, r)


@pytest.mark.applies("abort-before-scheduling")
def test_connector_half_alone_moves_the_crash_to_the_scheduler(run: dict[str, Any]) -> None:
    """Why the patch has a worker half: declining in request_finished alone is not enough."""
    c = run["rounds"]["request-finished-only"]
    assert c["live"] == {
        "request_finished": True,
        "build_connector_meta": False,
        "get_finished": False,
    }, c["live"]
    assert c["abort_error"] is None, c
    err = c["step_error"]
    assert err is not None, f"no crash without the worker half: {c}"
    assert err["type"] == "AssertionError", err
    assert err["function"] == "_update_from_kv_xfer_finished", err


# ---------------------------------------------------------------------------
# Prefix caching: prefix-cache-slicing (0.22-0.23) and drafter-skip (0.25-0.28)

PREFIX_MAX_MODEL_LEN = 66  # 66 - 2 = 64 = four blocks of 16


def prefix_prompts() -> dict[str, list[int]]:
    import torch

    from hsfix_demo import tiny_model

    gen = torch.Generator().manual_seed(11)

    def rand(n: int) -> list[int]:
        return torch.randint(4, tiny_model.TEXT_VOCAB, (n,), generator=gen).tolist()

    base = rand(64)
    return {"W": [*base, 5], "S": [*base, 6], "R": rand(10), "P": [*base, 7], "Q": rand(20)}


SLICING, SKIP = "prefix-cache-slicing", "drafter-skip"
# The rows that fix the two prefix hazards: disabled, the release alone.
ROWS = {SLICING: "slots-from-blocks", SKIP: "drafter-skip-guard"}


def prefix_case(work: Path, **env: str) -> dict[str, Any]:
    args = {
        "model": str(model_dir()),
        "aux_ids": AUX_IDS,
        "out": str(work / "hs"),
        "prompts": prefix_prompts(),
        "max_model_len": PREFIX_MAX_MODEL_LEN,
    }
    result = run_script("prefix_case.py", args, work, "HSFIX_PREFIX_RESULT", **env)
    assert result["error"] is None, result["error"]
    result["files"] = compare_files(result["paths"], prefix_prompts())
    print(json.dumps(result["files"]))
    return result


@pytest.fixture(scope="module")
def prefix_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """vllm-hsfix as a user runs it."""
    return prefix_case(tmp_path_factory.mktemp("prefix"))


@pytest.fixture(scope="module")
def release_alone(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same engine with the prefix hazards' rows disabled: the release's own code."""
    disabled = ",".join(ROWS.values())
    return prefix_case(tmp_path_factory.mktemp("alone"), VLLM_HSFIX_DISABLED_PATCHES=disabled)


def test_prefix_files_are_right(prefix_run: dict[str, Any]) -> None:
    """Every release: W (fills the cache), S (64 of 65 tokens from the prefix cache,
    alone), R (decodes), P (a hit but for one token) and Q (new) beside R's decode:
    every file right row by row, the drafter run in every step, no WARNING."""
    files = prefix_run["files"]
    assert all(right(files[r]) for r in "WSRPQ"), files
    assert all(prefix_run["fits"]), prefix_run["fits"]
    assert prefix_run["hsfix_warnings"] == [], prefix_run["hsfix_warnings"]
    for hazard, row in ROWS.items():
        if hazards.by_id(hazard).affects(RELEASE):
            assert prefix_run["patches"][row] == "applied", prefix_run["patches"]


@pytest.mark.hazard(SLICING)
def test_prefix_hit_alone_is_cut_short_and_the_audit_names_it(
    release_alone: dict[str, Any],
) -> None:
    """0.22-0.23, the release alone: S comes out wrong, short of rows; the audit's
    finding on it names the hazard (fewer rows than token ids). W stays right."""
    files = release_alone["files"]
    assert right(files["W"]), files["W"]
    assert not right(files["S"]), files["S"]
    assert files["S"]["shape"][0] < len(prefix_prompts()["S"]), files["S"]
    verdict, found = audit(release_alone["paths"]["S"])
    assert found.get("token_mismatch") == SLICING and verdict == "corrupt", found


def audit(path: str) -> tuple[str, dict[str, str | None]]:
    """The audit's verdict on one file, and its findings: code -> the hazard named."""
    from vllm_hsfix.audit import pipeline

    rep = pipeline.check_file(path)
    return rep.verdict, {p.code: p.hazard for p in rep.problems}


@pytest.mark.hazard(SKIP)
def test_padded_prefix_hit_skips_the_drafter(release_alone: dict[str, Any]) -> None:
    """0.25-0.28, the release alone: P is padded to max_model_len and the drafter skipped
    for that step: P's last row and every row of Q are never written."""
    files, p = release_alone["files"], prefix_prompts()
    assert right(files["R"]), files["R"]
    assert False in release_alone["fits_after_pq"], release_alone["fits_after_pq"]
    assert files["P"]["wrong_positions"] == [len(p["P"]) - 1], files["P"]
    assert files["Q"]["wrong_positions"] == list(range(len(p["Q"]))), files["Q"]


@pytest.mark.hazard(SLICING)
def test_padded_prefix_hit_with_a_decode_is_sliced_wrong(release_alone: dict[str, Any]) -> None:
    """0.22-0.23, the release alone: the step's slot mapping is sliced from offset 0
    while R's decode comes first: P or Q wrong."""
    files = release_alone["files"]
    assert right(files["R"]), files["R"]
    assert not (right(files["P"]) and right(files["Q"])), (files["P"], files["Q"])
