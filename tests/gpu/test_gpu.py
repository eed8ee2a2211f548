"""The scatter fix on a CUDA device, and the bug it fixes in the releases' own code; marked
``gpu``. Switches (docs/testing.md, "GPU check"): ``VLLM_HSFIX_CHECK_DEVICE=cpu``,
``VLLM_HSFIX_CHECK_PLANT=unclamped|wrong-slot|syncs`` (every ``replacement`` test must
then fail, no other), ``VLLM_HSFIX_RELEASE_CODE=DIR``, ``VLLM_HSFIX_REQUIRE_RELEASE_CODE=1``."""

from __future__ import annotations

import os

import pytest
import torch
from support.procs import child_json
from support.scatter_check import (
    RELEASE_SHAPES,
    assert_original_overwrites_live_slot,
    assert_replacement_keeps_live_slot,
    load_release,
    padded_run,
    replacement,
    run_eager,
    run_graph,
    scratch_problems,
)

from vllm_hsfix.patches.scatter_clamp import checks as scatter_checks

DEVICE_ENV = "VLLM_HSFIX_CHECK_DEVICE"


def _device() -> str | None:
    requested = os.environ.get(DEVICE_ENV, "cuda")
    if requested not in ("cuda", "cpu"):
        raise ValueError(f"{DEVICE_ENV}={requested!r}: expected 'cuda' or 'cpu'")
    if requested == "cpu":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


DEVICE = _device()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE is None,
        reason=f"no CUDA device on this machine ({DEVICE_ENV}=cpu runs the byte checks on CPU)",
    ),
]
cuda_only = pytest.mark.skipif(
    DEVICE != "cuda",
    reason="host-sync and CUDA-graph checks need a CUDA device",
)

# A flat-view release views the cache, which a strided buffer cannot be.
RELEASE_LAYOUTS = [
    pytest.param(v, strided, id=f"{v}-{'strided' if strided else 'contiguous'}")
    for v, shape in RELEASE_SHAPES.items()
    for strided in ((False,) if shape == "flat-view" else (False, True))
]
REPLACEMENT_LAYOUTS = [
    pytest.param("flat-view", False, id="scatter_flat-contiguous"),
    pytest.param("2d-index", False, id="scatter_clamped-contiguous"),
    pytest.param("2d-index", True, id="scatter_clamped-strided"),
]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("shape", "strided"), REPLACEMENT_LAYOUTS)
def test_replacement_bytes(shape: str, strided: bool, dtype: torch.dtype) -> None:
    assert DEVICE is not None
    case = scatter_checks.scratch_case(
        device=DEVICE,
        dtype=dtype,
        strided=strided,
        num_blocks=64,
        block_size=22,
        heads=3,
        head=256,
        padding=40,
    )
    last = case["kv_cache"][-1, -1].clone()
    assert scratch_problems(replacement(shape), case) == []
    assert torch.equal(case["kv_cache"][-1, -1], last)


@cuda_only
@pytest.mark.parametrize(("shape", "strided"), REPLACEMENT_LAYOUTS)
def test_replacement_no_host_sync(shape: str, strided: bool) -> None:
    case = scatter_checks.scratch_case(device="cuda", dtype=torch.bfloat16, strided=strided)
    fn = replacement(shape)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(case["rows"], case["kv_cache"], case["slots"])
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()


@cuda_only
@pytest.mark.parametrize(("shape", "strided"), REPLACEMENT_LAYOUTS)
def test_replacement_cuda_graph_replays_new_inputs(shape: str, strided: bool) -> None:
    fn = replacement(shape)
    static = scatter_checks.scratch_case(
        device="cuda", dtype=torch.bfloat16, strided=strided, seed=1
    )
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(static["rows"], static["kv_cache"], static["slots"])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(static["rows"], static["kv_cache"], static["slots"])
    for seed in (2, 3):
        fresh = scatter_checks.scratch_case(
            device="cuda", dtype=torch.bfloat16, strided=strided, seed=seed
        )
        assert not torch.equal(fresh["slots"], static["slots"])  # really new inputs
        for key in ("base", "rows", "slots"):
            static[key].copy_(fresh[key])
        assert scratch_problems(lambda *_: graph.replay(), static) == [], f"seed {seed}"


@pytest.mark.parametrize(("version", "strided"), RELEASE_LAYOUTS)
def test_release_original_overwrites_the_live_last_slot(version: str, strided: bool) -> None:
    assert DEVICE is not None
    run = padded_run(DEVICE, torch.bfloat16, strided)
    assert_original_overwrites_live_slot(run, run_eager(load_release(version).original, run))


@pytest.mark.parametrize(("version", "strided"), RELEASE_LAYOUTS)
def test_release_replacement_keeps_the_live_last_slot(version: str, strided: bool) -> None:
    assert DEVICE is not None
    run = padded_run(DEVICE, torch.bfloat16, strided)
    assert_replacement_keeps_live_slot(run, run_eager(load_release(version).patched(), run))


@cuda_only
@pytest.mark.parametrize(("version", "strided"), RELEASE_LAYOUTS)
def test_release_original_in_cuda_graph_overwrites_the_live_last_slot(
    version: str, strided: bool
) -> None:
    run = padded_run("cuda", torch.bfloat16, strided)
    assert_original_overwrites_live_slot(run, run_graph(load_release(version).original, run))


@cuda_only
@pytest.mark.parametrize(("version", "strided"), RELEASE_LAYOUTS)
def test_release_replacement_in_cuda_graph_keeps_the_live_last_slot(
    version: str, strided: bool
) -> None:
    run = padded_run("cuda", torch.bfloat16, strided)
    assert_replacement_keeps_live_slot(run, run_graph(load_release(version).patched(), run))


@pytest.mark.parametrize(
    "version", [v for v, shape in RELEASE_SHAPES.items() if shape == "flat-view"]
)
def test_flat_view_release_and_replacement_refuse_a_strided_view(version: str) -> None:
    """A flat-view release views the cache, which a strided buffer cannot be: its
    replacement must fail there exactly as the release does, never store elsewhere."""
    assert DEVICE is not None
    release = load_release(version)
    for fn in (release.original, release.patched()):
        run = padded_run(DEVICE, torch.bfloat16, strided=True)
        rows, slots = run.steps[1]
        with pytest.raises(RuntimeError, match="view"):
            fn(rows, run.kv_cache, slots)
        assert torch.equal(run.base, run.initial), "bytes changed before the error"


@cuda_only
def test_activation_and_plugin_do_not_initialise_cuda() -> None:
    """Initialising CUDA in vLLM's process 0 would force its workers into spawn."""
    assert child_json("startup.py", "cuda_untouched", env=dict(os.environ)) is False
