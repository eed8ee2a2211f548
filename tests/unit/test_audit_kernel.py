"""The audit's compiled fp8 kernel (numba): its squared norms are torch's, and every
finding, statistic and prefix sketch is the same with it as without it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from support import hsrows
from support.hsfiles import hs_file
from support.procs import audit_child

from vllm_hsfix.audit import decode, scan
from vllm_hsfix.audit.decode import fp8_e4m3fn_table

pytest.importorskip("numba")
from vllm_hsfix.audit import kernel


def _run(raw: np.ndarray, scales: Any, sumsq: np.ndarray, keys: np.ndarray) -> bool:
    cols, mult = decode.key_columns(raw.shape[1])
    return kernel.fp8(fp8_e4m3fn_table(), raw, scales, cols, mult, sumsq, keys)


@pytest.mark.parametrize("hidden", [7, 256, 4096])
def test_the_kernels_squared_norms_are_torchs(hidden: int, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(hidden)
    rows = torch.randn(30, 4, hidden, generator=g) * torch.logspace(-3, 3, 30)[:, None, None]
    path = hsrows.write_fp8(tmp_path / "r.safetensors", rows, list(range(30)))
    t = load_file(str(path))  # the stored rows [tokens x n_aux, hidden], as the scan reads them
    raw = t["hidden_states"].view(torch.uint8).numpy().reshape(30 * 4, -1)
    scales = np.repeat(t["hidden_states_scales"].reshape(-1).float().numpy(), 4)
    cols, mult = decode.key_columns(hidden)
    sumsq, keys = np.zeros(len(raw)), np.zeros(len(raw), np.uint64)
    assert _run(raw, scales, sumsq, keys) is False
    values = hsrows.dequantized(path).double()  # as the consumer reads them (torch)
    want = (values**2).sum(dim=-1).reshape(-1).numpy()
    np.testing.assert_allclose(sumsq, want, rtol=2e-5)
    # The row keys sample the bits of the de-quantized values the consumer reads.
    bits = values.float().reshape(len(raw), -1).numpy().view(np.uint32)
    sample = bits[:, cols].astype(np.uint64) * mult
    np.testing.assert_array_equal(keys, sample.sum(axis=1, dtype=np.uint64))


def _damaged(root: Path) -> list[Path]:
    """Clean and damaged files of every format the kernel takes."""
    g = torch.Generator().manual_seed(5)

    def rows(scale: float = 1.0) -> torch.Tensor:
        return torch.randn(48, 3, 256, generator=g) * scale

    out = [hs_file(root / f"bf16_{i}.safetensors", tokens=48, seed=i) for i in range(3)]
    out.append(
        hs_file(root / "zero.safetensors", tokens=48, seed=7, edit=lambda h, i: h[30, 2].zero_())
    )
    out.append(hs_file(root / "nan.safetensors", tokens=48, seed=8,
                       edit=lambda h, i: h[40, 1, 5:9].fill_(float("nan"))))  # fmt: skip
    out.append(hs_file(root / "inf.safetensors", tokens=48, seed=9,
                       edit=lambda h, i: h[2, 0, 3].fill_(float("inf"))))  # fmt: skip

    def dup(h: torch.Tensor, i: torch.Tensor) -> None:
        h[33, 1] = h[20, 1]

    out.append(hs_file(root / "dup.safetensors", tokens=48, seed=10, edit=dup))
    big = rows(3e19)  # squares past float32: the sum overflows, the values do not
    save_file({"hidden_states": big, "token_ids": torch.arange(48)}, str(root / "big.safetensors"))
    out.append(root / "big.safetensors")
    save_file(
        {"hidden_states": rows(), "token_ids": torch.arange(48)}, str(root / "f32.safetensors")
    )
    out.append(root / "f32.safetensors")
    out.append(hsrows.write_fp8(root / "fp8.safetensors", rows(), list(range(48))))
    fp8_nan = hsrows.write_fp8(root / "fp8_nan.safetensors", rows(), list(range(48)))
    t = load_file(str(fp8_nan))
    t["hidden_states"].view(torch.uint8)[11, 2, 4] = 0x7F  # float8_e4m3fn NaN
    save_file(t, str(fp8_nan))
    out.append(fp8_nan)
    fp8_zero = hsrows.write_fp8(root / "fp8_zero.safetensors", rows(), list(range(48)))
    t = load_file(str(fp8_zero))
    t["hidden_states"].view(torch.uint8)[45, 0] = 0
    save_file(t, str(fp8_zero))
    out.append(fp8_zero)
    return out


def _judged(paths: list[Path]) -> tuple[list[dict[str, Any]], list[float | None], list[Any]]:
    """Every file's report, apart the norm statistics (float32 sums in another order:
    equal to about 1e-7, compared with a tolerance), and its prefix sketches."""
    reports, stats, prefixes = [], [], []
    for p in paths:
        rep = scan.audit_file(p)
        prefixes.append(rep.prefix)
        d = rep.to_dict()
        d.pop("seconds")
        for st in d["layers"]:
            for k in list(st):
                if k.endswith("_norm"):
                    stats.append(st.pop(k))
        reports.append(d)
    return reports, stats, prefixes


def test_every_finding_is_the_same_with_the_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = _damaged(tmp_path)
    monkeypatch.setattr(decode, "_kernel", False)
    without = _judged(paths)
    monkeypatch.setattr(decode, "_kernel", None)
    assert decode.enable(decode.MIN_BYTES)
    used = []
    real = kernel.fp8

    def counting(*args: Any) -> bool:
        odd = real(*args)
        used.append(not odd)
        return odd

    monkeypatch.setattr(kernel, "fp8", counting)
    with_kernel = _judged(paths)
    assert with_kernel[0] == without[0]
    assert with_kernel[1] == pytest.approx(without[1], rel=1e-6)
    for path, a, b in zip(paths, without[2], with_kernel[2], strict=True):
        assert (a is None) == (b is None), path
        if a is not None:
            assert a.token_ids == b.token_ids
            for name in ("sketches", "norms", "sound"):
                np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=path.name)
    # It ran on the fp8 files (and the damaged one's windows went the numpy way).
    assert True in used and False in used
    verdicts = {Path(d["path"]).name: d["verdict"] for d in without[0]}
    assert verdicts == {
        "bf16_0.safetensors": "ok", "bf16_1.safetensors": "ok", "bf16_2.safetensors": "ok",
        "zero.safetensors": "corrupt", "nan.safetensors": "corrupt", "inf.safetensors": "corrupt",
        "dup.safetensors": "suspect", "big.safetensors": "ok", "f32.safetensors": "ok",
        "fp8.safetensors": "ok", "fp8_nan.safetensors": "corrupt",
        "fp8_zero.safetensors": "corrupt",
    }  # fmt: skip


def _enabled(env: dict[str, str], total: int) -> bool:
    out = audit_child("kernel_enabled", total, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_kernel_is_used_only_past_min_bytes_and_can_be_switched_off() -> None:
    env = {k: v for k, v in os.environ.items() if k != decode.KERNEL_ENV}
    assert _enabled(env, decode.MIN_BYTES - 1) is False
    assert _enabled(env, decode.MIN_BYTES) is True
    assert _enabled({**env, decode.KERNEL_ENV: "0"}, decode.MIN_BYTES) is False


def test_a_large_audit_loads_the_kernel_at_its_first_fp8_file_only(tmp_path: Path) -> None:
    """Past MIN_BYTES a worker's bf16 files leave numba unimported; its first fp8 file
    loads the kernel (the verdicts are the numpy path's either way)."""
    bf16 = hs_file(tmp_path / "bf16.safetensors", tokens=20)
    rows = torch.randn(20, 3, 64, generator=torch.Generator().manual_seed(1))
    fp8 = hsrows.write_fp8(tmp_path / "fp8.safetensors", rows, list(range(20)))
    env = {k: v for k, v in os.environ.items() if k != decode.KERNEL_ENV}
    out = audit_child("kernel_loads", bf16, fp8, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [["ok", False, False], ["ok", True, True]], out.stdout


def test_the_fp8_kernel_squares_every_byte_value() -> None:
    """Every float8_e4m3fn byte squares to torch's decode squared, scaled; NaN makes a row odd."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = every[(every & 0x7F) != 0x7F]  # 254 bytes: all but the two NaNs
    raw = torch.stack([finite, finite.flip(0), finite.roll(7)]).numpy()
    values = torch.from_numpy(raw.copy()).view(torch.float8_e4m3fn).double()
    scale = np.array([1.0, 2.0**-20, 3.5], dtype=np.float32)
    want = (values**2).sum(dim=1).numpy() * scale.astype(np.float64) ** 2
    sumsq, keys = np.zeros(3), np.zeros(3, np.uint64)
    assert _run(raw, scale, sumsq, keys) is False
    np.testing.assert_allclose(sumsq, want, rtol=1e-6)
    nan_row = raw.copy()
    nan_row[1, 100] = 0xFF
    assert _run(nan_row, scale, sumsq, keys) is True
    assert np.isnan(sumsq[1]) and not np.isnan(sumsq[0])
