"""Prefix caching, vLLM's default, on the releases whose connector cut each new
request's rows out of the step (0.22-0.23; they refuse chunked prefill with this
connector): every file right with the fix, files short or foreign without it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import CACHE

from hsfix_demo import e2e

pytestmark = [pytest.mark.e2e, pytest.mark.needs_vllm, pytest.mark.applies("slots-from-blocks")]

# 16 prompts sharing a 140-token prefix (more than one 128-token CPU block), at most 8
# running: later prompts hit the prefix cache, several new prompts share a step.
CASE = dataclasses.replace(
    e2e.CASES["dense-mp"],
    name="shared-prefix",
    prompts="shared",
    engine=(("enable_prefix_caching", True), ("max_num_seqs", 8)),
)


def run(tmp_path: Path, **env: str) -> e2e.Result:
    return e2e.run_case(
        CASE, patched=True, workdir=tmp_path, models=CACHE / "models", extra_env=env
    )


def test_prefix_cached_prompts_are_saved_whole(tmp_path: Path) -> None:
    r = run(tmp_path)
    assert r.ok_run, r.error
    assert r.requests == 16 and not r.mismatched, r.mismatched
    assert r.rows_correct == r.rows > 0 and r.requests_correct == r.requests, r.as_dict()


@pytest.mark.extended  # CI time; its fails-first result is in the note and docs/hazards.md
def test_without_the_fix_files_are_short_or_foreign(tmp_path: Path) -> None:
    """Fails first: the release's own save on the same run."""
    r = run(tmp_path, VLLM_HSFIX_DISABLED_PATCHES="slots-from-blocks")
    assert r.ok_run, r.error
    assert r.mismatched or r.requests_correct < r.requests, r.as_dict()
