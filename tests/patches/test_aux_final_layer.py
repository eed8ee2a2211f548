"""``aux-final-layer`` on the live ``DeepseekV2Model.forward``, no engine: ``verify``'s
check, a non-last pipeline rank, and vLLM's compile-cache keys."""

from __future__ import annotations

import importlib
import types
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_hsfix.patches.aux_final_layer import fix as aux_fix

pytestmark = [pytest.mark.needs_vllm, pytest.mark.applies("aux-final-layer")]
MODULE = "vllm.model_executor.models.deepseek_v2"


@pytest.fixture
def forwards(patched: Any) -> tuple[Any, Any]:
    """(the patched forward, the release's own), vllm-hsfix active."""
    cls = importlib.import_module(MODULE).DeepseekV2Model
    ours = cls.__dict__["forward"]
    assert ours is not ours.__wrapped__, "aux-final-layer is not applied"
    return ours, ours.__wrapped__


def test_the_check_fails_on_the_release_and_passes_patched(forwards: tuple[Any, Any]) -> None:
    ours, release = forwards
    assert aux_fix.check_aux_capture(type("Release", (), {"forward": release})) == [
        "2 aux states for 3 ids"
    ]
    assert aux_fix.check_aux_capture(type("Patched", (), {"forward": ours})) == []


def test_a_rank_before_the_last_passes_its_tensors_on(forwards: tuple[Any, Any]) -> None:
    """Upstream captures after the pipeline check: an earlier rank returns its
    ``IntermediateTensors`` (hidden states, residual) and captures nothing more."""
    import torch

    ours, _ = forwards
    rank = SimpleNamespace(is_first_rank=False, is_last_rank=False)
    glb = {**ours.__globals__, "get_pp_group": lambda: rank}
    fn = types.FunctionType(ours.__code__, glb, "forward", ours.__defaults__)
    layer = lambda positions, h, r, *rest: (h * 2, h + r)  # noqa: E731
    layer.use_sequence_parallel_moe = False  # type: ignore[attr-defined]
    model = SimpleNamespace(config=SimpleNamespace(), layers=[layer, layer], hidden_size=1)
    model.__dict__.update(start_layer=0, end_layer=2, aux_hidden_state_layers=(1, 2))
    h, r = torch.ones(3, 1), torch.ones(3, 1)
    out = fn(model, None, torch.arange(3), {"hidden_states": h, "residual": r})
    assert torch.equal(out["hidden_states"], torch.full((3, 1), 4.0))
    assert torch.equal(out["residual"], torch.full((3, 1), 4.0))


def test_vllms_compile_cache_keys_tell_the_forwards_apart(forwards: tuple[Any, Any]) -> None:
    """vLLM's AOT and inductor cache keys tell the patched forward from the release's."""
    decorators = importlib.import_module("vllm.compilation.decorators")
    if not hasattr(decorators, "_model_hash_key"):
        pytest.skip("this release has no AOT compile cache key (_model_hash_key)")
    ours, release = forwards
    assert decorators._model_hash_key(ours) != decorators._model_hash_key(release)
    assert ours.__code__.co_filename != release.__code__.co_filename
    assert ours.__code__.co_firstlineno == release.__code__.co_firstlineno  # tracebacks
