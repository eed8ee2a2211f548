"""The patched scatter on a CUDA device: bytes, no host sync, CUDA-graph capture.

Marked ``gpu``: skipped with a reason on machines without CUDA. Needs torch only (no
vLLM: the device machine has none), so it checks the function vllm-hsfix installs as
``basic_cache`` directly; ``vllm-hsfix verify --device cuda`` runs the same checks
on the live vLLM function where vLLM is installed. ``scripts/gpu_check.sh`` runs these
tests and the scatter benchmark in one go on a lent GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from vllm_hsfix import checks
from vllm_hsfix.patches.scatter import scatter_clamped

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("strided", [False, True])
def test_rows_land_and_padding_only_in_block_zero(dtype: torch.dtype, strided: bool) -> None:
    case = checks.scratch_case(
        device="cuda",
        dtype=dtype,
        strided=strided,
        num_blocks=64,
        block_size=22,
        heads=3,
        head=256,
        padding=40,
    )
    assert checks.check_scatter(scatter_clamped, case) == []


def test_no_host_device_synchronisation() -> None:
    case = checks.scratch_case(device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        scatter_clamped(case["rows"], case["kv_cache"], case["slots"])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_a_check_that_syncs_is_caught() -> None:
    # The sync check itself can fail: a data-dependent branch is reported.
    slots = torch.tensor([1, -1], device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            bool((slots < 0).any())
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_capture_and_replay_with_new_inputs() -> None:
    results = checks.cuda_checks(scatter_clamped)
    assert [r["check"] for r in results] == ["no host-device sync", "CUDA graph capture and replay"]
    assert all(r["ok"] for r in results), results


def test_activation_and_plugin_do_not_initialise_cuda() -> None:
    """Initialising CUDA in vLLM's process 0 would force its workers into spawn."""
    import subprocess
    import sys

    code = (
        "import torch, vllm_hsfix, vllm_hsfix.plugin\n"
        "vllm_hsfix.plugin.register(); vllm_hsfix.apply(); vllm_hsfix.status()\n"
        "print(torch.cuda.is_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr
