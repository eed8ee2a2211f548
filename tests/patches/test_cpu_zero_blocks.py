"""``cpu-zero-blocks`` on a real ``CPUModelRunner`` (made without its ``__init__``) with a
real ``KVCacheConfig`` and ``CompilationConfig``."""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_hsfix.patches.cpu_zero_blocks import checks as zero_checks
from vllm_hsfix.patches.cpu_zero_blocks import fix as patch

pytestmark = pytest.mark.needs_vllm
RUNNER_MODULE = "vllm.v1.worker.cpu_model_runner"
NUM_BLOCKS = 8


def _runner(kv_split: int = 1) -> tuple[Any, dict[str, torch.Tensor]]:
    """A real CPUModelRunner with a hybrid layout full of NaN (``cpu_runner_case``), its
    attention cache in the release's own layout (0.22-0.23: K and V first)."""
    return zero_checks.cpu_runner_case(
        importlib.import_module(RUNNER_MODULE).CPUModelRunner, kv_split
    )


def _zeroed_blocks(t: torch.Tensor) -> list[int]:
    flat = t.reshape(NUM_BLOCKS, -1)
    return [b for b in range(NUM_BLOCKS) if bool((flat[b] == 0).all())]


@pytest.mark.applies("cpu-zero-blocks")
def test_the_release_method_leaves_stale_bytes(patched: Any) -> None:
    """What makes the test below able to fail: the shipped method zeroes nothing."""
    runner, bufs = _runner()
    live = type(runner).__dict__[patch.METHOD]
    live.__wrapped__(runner, [2, 5])
    assert _zeroed_blocks(bufs["attention"]) == [] and bool(bufs["attention"].isnan().all())


@pytest.mark.applies("cpu-zero-blocks")
@pytest.mark.parametrize("kv_split", [1, 2], ids=["block-per-row", "kernel-blocks-split-2"])
def test_patched_runner_zeroes_exactly_the_listed_blocks(patched: Any, kv_split: int) -> None:
    importlib.import_module(RUNNER_MODULE)
    assert patched.status()["patches"][patch.PATCH_ID]["status"] == "applied"
    runner, bufs = _runner(kv_split)
    runner._zero_block_ids([2, 5])
    assert _zeroed_blocks(bufs["attention"]) == [2, 5]
    assert _zeroed_blocks(bufs["hidden"]) == [2, 5]
    untouched = [b for b in range(NUM_BLOCKS) if b not in (2, 5)]
    assert bool(bufs["attention"][untouched].isnan().all())
    runner._zero_block_ids([])  # the scheduler's "nothing new" is a no-op
    assert _zeroed_blocks(bufs["attention"]) == [2, 5]


@pytest.mark.applies("cpu-zero-blocks")
def test_a_view_that_does_not_divide_into_blocks_is_an_error(patched: Any) -> None:
    importlib.import_module(RUNNER_MODULE)
    runner, _ = _runner()
    odd = torch.zeros(NUM_BLOCKS + 3, 4)
    runner.compilation_config.static_forward_context["model.layers.1.self_attn.attn"] = (
        SimpleNamespace(kv_cache=odd)
    )
    with pytest.raises(ValueError, match="cannot tell which memory block ids address"):
        runner._zero_block_ids([1])


def test_shapes_the_gate_refuses() -> None:
    import ast

    def probe(body: str) -> Any:
        src = f"class CPUModelRunner:\n    def _zero_block_ids(self, block_ids):\n{body}\n"
        return patch.probe_tree(ast.parse(src))

    assert probe("        pass").shape == "no-op"
    assert probe("        '''doc'''\n        return").shape == "no-op"
    assert probe("        for b in block_ids:\n            self.kv[b].zero_()").fixed
    unknown = probe("        self.log(block_ids)")
    assert unknown.shape is None and not unknown.fixed
    wrong_sig = patch.probe_tree(
        ast.parse(
            "class CPUModelRunner:\n    def _zero_block_ids(self, ids, extra):\n        pass\n"
        )
    )
    assert wrong_sig.shape is None and "_zero_block_ids(self, block_ids)" in wrong_sig.detail
