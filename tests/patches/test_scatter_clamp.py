"""The real ``basic_cache`` of the installed release, unpatched and patched."""

from __future__ import annotations

import importlib

import pytest
import torch
from conftest import MODEL_MODULE, RELEASE
from packaging.version import Version

from vllm_hsfix.patches.scatter_clamp import checks as scatter_checks

pytestmark = pytest.mark.needs_vllm


def _last_slot(case: dict) -> torch.Tensor:
    return case["kv_cache"][-1, -1]


def _padding_rows(case: dict) -> torch.Tensor:
    return case["rows"][case["slots"] < 0]


def _is_padding_row(row: torch.Tensor, case: dict) -> bool:
    return any(torch.equal(row, r) for r in _padding_rows(case))


@pytest.mark.applies("scatter-clamp")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unpatched_release_writes_padding_into_the_last_block(dtype: torch.dtype) -> None:
    import vllm_hsfix

    vllm_hsfix.unapply()
    module = importlib.import_module(MODEL_MODULE)
    assert getattr(module.basic_cache, "hsfix_patch", None) is None
    case = scatter_checks.scratch_case(device="cpu", dtype=dtype)
    problems = scatter_checks.check_scatter(module.basic_cache, case)
    # The bug, shown on the release's own code: a padding row lands in the last slot.
    assert _is_padding_row(_last_slot(case), case)
    assert any("padding or stray writes" in p for p in problems)


@pytest.mark.applies("scatter-clamp")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("strided", [False, True])
def test_patched_release_sends_padding_to_block_zero(
    patched: object, dtype: torch.dtype, strided: bool
) -> None:
    module = importlib.import_module(MODEL_MODULE)
    # Keyed on the installed release, not on vllm-hsfix's report of itself.
    flat_view_release = Version(RELEASE or "0") < Version("0.22.0")
    if strided and flat_view_release:
        pytest.skip("0.17-0.21's own flat view() cannot take a strided buffer, patched or not")
    case = scatter_checks.scratch_case(device="cpu", dtype=dtype, strided=strided)
    sentinel = _last_slot(case).clone()
    problems = scatter_checks.check_scatter(module.basic_cache, case)
    assert problems == []
    assert torch.equal(_last_slot(case), sentinel)  # the last block is untouched
    assert _is_padding_row(case["kv_cache"][0, 0], case)  # padding went to the null block
    real = case["slots"] >= 0
    flat = case["kv_cache"].reshape(-1, *case["kv_cache"].shape[2:])
    assert torch.equal(flat[case["slots"][real]], case["rows"][real])


@pytest.mark.applies("scatter-clamp")
def test_vllms_own_caller_reaches_the_patched_function(patched: object) -> None:
    """CacheOnlyAttentionImpl.do_kv_cache_update looks basic_cache up at call time."""
    module = importlib.import_module(MODEL_MODULE)
    impl = module.CacheOnlyAttentionImpl(3, 16, "auto", torch.bfloat16, "decoder")
    case = scatter_checks.scratch_case(device="cpu", dtype=torch.bfloat16)
    sentinel = _last_slot(case).clone()
    impl.do_kv_cache_update(None, case["rows"], case["kv_cache"], case["slots"])
    assert torch.equal(_last_slot(case), sentinel)
    assert _is_padding_row(case["kv_cache"][0, 0], case)


@pytest.mark.fixed_upstream("hidden-group-block-size")
def test_fixed_release_is_left_alone_and_is_right() -> None:
    import vllm_hsfix

    module = importlib.import_module(MODEL_MODULE)
    vllm_hsfix.apply()
    rec = vllm_hsfix.status()["patches"]["scatter-clamp"]
    assert rec["code"] == "upstream-fix-present"
    assert getattr(module.basic_cache, "hsfix_patch", None) is None
    assert module.basic_cache.__module__ == MODEL_MODULE
    from conftest import INSTALL

    case = scatter_checks.scratch_case(device="cpu", dtype=torch.bfloat16)
    assert (
        scatter_checks.check_scatter(scatter_checks.live_scatter(module, INSTALL.version), case)
        == []
    )
