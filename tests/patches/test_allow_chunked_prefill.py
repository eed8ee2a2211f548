"""``allow-chunked-prefill`` on 0.22-0.23: the release refuses this connector with
chunked prefill (vLLM's default); patched, the release's own config method lets it
through where ``slots-from-blocks`` is in place and refuses it where that row is off.
End to end: prompts split into chunks after a prefix-cache hit write right files."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import CACHE, NO_HOOKS

from hsfix_demo import e2e
from vllm_hsfix.patches._wrap import ours_in
from vllm_hsfix.patches.allow_chunked_prefill import fix
from vllm_hsfix.patches.hooks import Hooks

pytestmark = [pytest.mark.needs_vllm, pytest.mark.applies(fix.PATCH_ID)]
REFUSAL = "does not support chunked prefill"


def config_module() -> object:
    from vllm.config import vllm as module

    return module


def own_wrapper_off() -> object | None:
    """Activation's wrapper, switched off (the caller switches it back on)."""
    ours = ours_in(config_module().VllmConfig.__dict__.get(fix.METHOD), fix.PATCH_ID)
    if ours is not None:
        ours.hsfix_set_active(False)
    return ours


def test_the_release_refuses_chunked_prefill() -> None:
    """Fails first: the release's own method, on this connector with the flag on."""
    ours = own_wrapper_off()
    try:
        assert fix.check_refusal(config_module(), in_place=False) == []
        problems = fix.check_refusal(config_module(), in_place=True)
        assert problems and REFUSAL in problems[0], problems
    finally:
        if ours is not None:
            ours.hsfix_set_active(True)


@pytest.mark.parametrize("in_place", [True, False], ids=["slots-from-blocks", "without"])
def test_patched_it_passes_only_with_slots_from_blocks(in_place: bool) -> None:
    from vllm.config import vllm as module

    ours = own_wrapper_off()
    hooks = Hooks(on_failure=NO_HOOKS.on_failure, in_place=lambda pid: in_place)
    reps = fix.apply(module, fix.SHAPE, hooks)
    try:
        assert fix.check_refusal(module, in_place) == []
    finally:
        for rep in reversed(reps):
            rep.restore()
        if ours is not None:
            ours.hsfix_set_active(True)


# 16 prompts sharing a 140-token prefix, 64 tokens computed per step: every prompt is
# split into chunks, after a 128-token prefix-cache hit for all but the first ones.
CASE = dataclasses.replace(
    e2e.CASES["dense-mp"],
    name="chunked-prefix",
    prompts="shared",
    engine=(
        ("enable_prefix_caching", True),
        ("enable_chunked_prefill", True),
        ("max_num_batched_tokens", 64),
        ("max_num_seqs", 8),
    ),
)


def run(tmp_path: Path, **env: str) -> e2e.Result:
    return e2e.run_case(
        CASE, patched=True, workdir=tmp_path, models=CACHE / "models", extra_env=env
    )


@pytest.mark.e2e
def test_chunked_prompts_write_right_files(tmp_path: Path) -> None:
    r = run(tmp_path)
    print(r.as_dict())
    assert r.ok_run, r.error
    assert r.requests == 16 and not r.mismatched, r.mismatched
    assert r.rows_correct == r.rows > 0 and r.requests_correct == r.requests, r.as_dict()


@pytest.mark.e2e
@pytest.mark.parametrize("off", [fix.PATCH_ID, fix.NEEDS])
def test_the_refusal_stands_without_either_row(tmp_path: Path, off: str) -> None:
    """Fails first (the row off), and the refusal kept where a chunked prompt's file
    would be wrong (slots-from-blocks off): the engine does not start, saying why."""
    r = run(tmp_path, VLLM_HSFIX_DISABLED_PATCHES=off)
    assert not r.ok_run and REFUSAL in (r.error or ""), r.as_dict()
