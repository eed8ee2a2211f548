"""``cpu-gdn-wide-conv-state`` on vLLM's real native conv kernels (``vllm._custom_ops``).

With a speculative method, a gated-delta-net layer's conv state is one position wider
than the convolution's window; on a CPU with AMX the release's kernels refuse it
(fails first, below), and the patched kernels must do on it exactly what the release's
kernels do on a state of the width they take, and what a causal convolution written
out here gives. The kernels run only where the CPU has AMX (elsewhere vLLM's layer
never calls them): the tests skip there, saying so. End to end, the tiny Qwen3.5
hybrid's engine dies at the first prompt without this row and is right with it.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CACHE
from support.e2eruns import result

from hsfix_demo import e2e
from vllm_hsfix.patches.cpu_gdn_wide_conv_state import fix as patch

AMX = torch.cpu._is_amx_tile_supported()
pytestmark = [
    pytest.mark.needs_vllm,
    pytest.mark.applies(patch.PATCH_ID),
    pytest.mark.skipif(
        not AMX, reason="this CPU has no AMX: vLLM's GDN layer never calls the native kernels"
    ),
]
DIM, WIDTH = 96, 4


def ops() -> Any:
    return importlib.import_module("vllm._custom_ops")


def conv(x: torch.Tensor, window: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> Any:
    """Causal depthwise conv + SiLU in float64: x [L, dim], window [dim, WIDTH-1]."""
    full = torch.cat([window.double(), x.t().double()], dim=1)
    out = torch.stack([(full[:, t : t + WIDTH] * w.double()).sum(-1) for t in range(len(x))])
    return torch.nn.functional.silu(out + b.double()), full[:, -(WIDTH - 1) :]


def prefill(cache: torch.Tensor, x: torch.Tensor, packed: Any, b: Any, slot: int) -> Any:
    return (
        ops()
        .causal_conv1d_fwd_cpu(
            x=x.t(),
            weight=packed,
            bias=b,
            conv_states=cache.transpose(1, 2),  # [slots, dim, state_len], as vLLM's AMX path
            query_start_loc=torch.tensor([0, len(x)], dtype=torch.int32),
            cache_indices=torch.tensor([slot], dtype=torch.int32),
            has_initial_state=torch.tensor([False]),
            silu_activation=True,
            is_vnni=True,
        )
        .t()
    )


def case() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(DIM, WIDTH, generator=g).to(torch.bfloat16)
    b = torch.randn(DIM, generator=g).to(torch.bfloat16)
    x = torch.randn(7, DIM, generator=g).to(torch.bfloat16)
    wide = torch.randn(5, WIDTH, DIM, generator=g).to(torch.bfloat16)  # one position more
    return w, b, x, wide


def test_the_release_kernel_refuses_a_wide_state() -> None:
    import vllm_hsfix

    vllm_hsfix.unapply()
    w, b, x, wide = case()
    with pytest.raises(RuntimeError, match=r"width - 1"):
        prefill(wide, x, ops().causal_conv1d_weight_pack(w), b, slot=3)


def test_the_patched_kernels_do_on_a_wide_state_what_the_release_does_on_a_narrow_one(
    patched: Any,
) -> None:
    w, b, x, wide = case()
    packed = ops().causal_conv1d_weight_pack(w)
    before = wide.clone()
    narrow = wide[:, : WIDTH - 1].contiguous()  # a state the release's kernel takes
    got = prefill(wide, x, packed, b, slot=3)
    want = prefill(narrow, x, packed, b, slot=3)
    assert torch.equal(got, want)
    assert torch.equal(wide[:, : WIDTH - 1], narrow)  # the same window written back
    assert torch.equal(wide[:, WIDTH - 1 :], before[:, WIDTH - 1 :])  # nothing past it
    assert torch.equal(wide[[0, 1, 2, 4]], before[[0, 1, 2, 4]])  # no other slot
    ref, window = conv(x, torch.zeros(DIM, WIDTH - 1), w, b)
    assert (got.double() - ref).abs().max() < 0.05 * ref.abs().max()
    assert torch.allclose(wide[3, : WIDTH - 1].t().double(), window, atol=1e-2)
    # And `vllm-hsfix verify`'s own check on the live module agrees.
    assert patch.check_wide_state(ops()) == []


@pytest.mark.e2e
def test_end_to_end_the_engine_dies_without_the_row_and_is_right_with_it(tmp_path: Any) -> None:
    """Every other patch on: without this row the release's prefill kernel refuses the
    wide state at the first prompt and the engine dies (its width check, or, in 2 of 6
    runs measured, a contiguity check first); with it every row is right."""
    off = {"VLLM_HSFIX_DISABLED_PATCHES": patch.PATCH_ID}
    case, models = e2e.CASES["hybrid-mp"], CACHE / "models"
    dead = e2e.run_case(case, patched=True, workdir=tmp_path, models=models, extra_env=off)
    err = str(dead.error)
    assert not dead.ok_run and dead.rows == 0, err  # nothing written
    log = Path(err.splitlines()[0].split("full log: ")[1]).read_text()
    assert "in causal_conv1d_fwd_cpu" in log, err
    width = "CHECK_EQ(conv_states_val.size(2), width - 1) failed. 4 vs 3"
    assert any(f"RuntimeError: {r}" in err for r in (width, "tensor must be contiguous")), err
    good = result(case.name, True, tmp_path)
    assert good.rows_correct == good.rows > 0 and good.rows_nan == 0
