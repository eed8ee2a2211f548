"""The audit's group pass (``vllm_hsfix.audit.batched``): many small files of one shape
judged as one array must give every file the verdict, findings and statistics the
per-file path gives it, on clean files and on every kind of damage (which the group
pass hands back to the per-file rules), and must lose nothing when it fails itself.
The expected verdicts come from how each file was made; the per-file path is the
reference for everything else (its own tests check it against torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from support import hsrows
from support.hsfiles import hs_file, write_raw

from vllm_hsfix.audit import batched, prefix, scan


def _corpus(root: Path) -> dict[str, tuple[Path, str]]:
    """Files of three shapes and four formats, clean and damaged: name -> (path, the
    verdict the way it was made implies)."""
    out: dict[str, tuple[Path, str]] = {}

    def add(name: str, path: Path, verdict: str) -> None:
        out[name] = (path, verdict)

    for i, tokens in enumerate([1, 2, 5, 16, 17, 40, 64, 3, 30, 33]):
        add(f"bf16_{i}", hs_file(root / f"bf16_{i}.safetensors", tokens=tokens, seed=i), "ok")
    for i in range(3):
        add(f"f16_{i}", hs_file(root / f"f16_{i}.safetensors", tokens=20 + i, seed=50 + i,
                                dtype=torch.float16), "ok")  # fmt: skip
        add(f"f32_{i}", hs_file(root / f"f32_{i}.safetensors", tokens=9 + i, seed=60 + i,
                                n_aux=4, hidden=96, dtype=torch.float32), "ok")  # fmt: skip
    for i in range(2):  # another shape, same dtype
        add(f"wide_{i}", hs_file(root / f"wide_{i}.safetensors", tokens=12, seed=70 + i,
                                 n_aux=2, hidden=512), "ok")  # fmt: skip

    def dup(h: torch.Tensor, ids: torch.Tensor) -> None:
        ids[:] = torch.arange(len(ids))
        h[30, 1] = h[4, 1]

    def same_token(h: torch.Tensor, ids: torch.Tensor) -> None:
        ids[7] = ids[2]  # one token id twice, the same row: legitimate
        h[7, 0] = h[2, 0]

    def aux_twice(h: torch.Tensor, ids: torch.Tensor) -> None:
        h[:, 2] = h[:, 1]

    def near_zero(h: torch.Tensor, ids: torch.Tensor) -> None:
        h[11, 0] *= 1e-5

    damage = {
        "zero": (lambda h, i: h[20, 2].zero_(), "corrupt"),
        "nan": (lambda h, i: h[0, 1, 3].fill_(float("nan")), "corrupt"),
        "inf": (lambda h, i: h[39, 0, 0].fill_(float("inf")), "corrupt"),
        "dup": (dup, "suspect"),
        "same_token": (same_token, "ok"),
        "aux_twice": (aux_twice, "corrupt"),
        "near_zero": (near_zero, "suspect"),
    }
    for k, (name, (edit, verdict)) in enumerate(damage.items()):
        add(
            name, hs_file(root / f"{name}.safetensors", tokens=40, seed=100 + k, edit=edit), verdict
        )
    big = torch.randn(24, 3, 256, generator=torch.Generator().manual_seed(3)) * 3e19
    save_file({"hidden_states": big, "token_ids": torch.arange(24)}, str(root / "big.safetensors"))
    add("big", root / "big.safetensors", "ok")  # squares past float32; values are not
    rows = torch.randn(20, 3, 256, generator=torch.Generator().manual_seed(4))
    add("fp8", hsrows.write_fp8(root / "fp8.safetensors", rows, list(range(20))), "ok")
    extra = {"hidden_states": rows.bfloat16(), "token_ids": torch.arange(20),
             "other": torch.zeros(2)}  # fmt: skip
    save_file(extra, str(root / "extra.safetensors"))
    add("extra", root / "extra.safetensors", "suspect")
    short = hs_file(root / "short_ids.safetensors", tokens=10, seed=5,
                    edit=None)  # fmt: skip
    add("short_ids", short, "ok")
    raw = (root / "bf16_5.safetensors").read_bytes()
    add("truncated", write_raw(root / "truncated.safetensors", raw[:-100]), "corrupt")
    add("junk", write_raw(root / "junk.safetensors", b"not tensors" * 20), "corrupt")
    return out


def _plain(rep: scan.FileReport) -> tuple[dict[str, Any], list[float]]:
    """The report as a dict without its time, and apart its norm statistics (sums in
    another order: equal to rounding, compared with a tolerance)."""
    d = rep.to_dict()
    d.pop("seconds")
    stats = []
    for st in d["layers"]:
        for k in [k for k in st if k.endswith("_norm")]:
            stats.append(st.pop(k))
    return d, stats


def _prefix(rep: scan.FileReport) -> Any:
    p = rep.prefix
    return None if p is None else (p.token_ids, p.sketches.astype(np.float32), p.norms, p.sound)


@pytest.fixture
def corpus(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    return _corpus(tmp_path)


def _compare(got: list[scan.FileReport], paths: list[str]) -> None:
    for rep, path in zip(got, paths, strict=True):
        want = scan.audit_file(path)
        (g, g_stats), (w, w_stats) = _plain(rep), _plain(want)
        assert g == w, path
        assert g_stats == pytest.approx(w_stats, rel=1e-9), path
        gp, wp = _prefix(rep), _prefix(want)
        assert (gp is None) == (wp is None), path
        if gp is not None:
            assert gp[0] == wp[0]
            np.testing.assert_allclose(gp[1], wp[1], atol=2e-3)  # float16 unit vectors
            np.testing.assert_allclose(gp[2], wp[2], rtol=1e-5)
            np.testing.assert_array_equal(gp[3], wp[3])


def test_the_group_pass_gives_every_file_the_per_file_verdict(
    corpus: dict[str, tuple[Path, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = [str(p) for p, _ in corpus.values()]
    grouped: list[str] = []
    real = batched._group_pass

    def spy(items: list[Any], done: list[bool]) -> set[int]:
        alone = real(items, done)
        grouped.extend(Path(it[1].path).stem for k, it in enumerate(items) if k not in alone)
        return alone

    monkeypatch.setattr(batched, "_group_pass", spy)
    with prefix.single_blas_thread():
        got = batched.audit_files(paths)
    assert {Path(r.path).stem: r.verdict for r in got} == {
        name: verdict for name, (_, verdict) in corpus.items()
    }
    _compare(got, paths)
    # The group pass judged the small files of the plain formats whose rows are all
    # sound and unrepeated (a near-zero row is its own finding; "big": squares past
    # float32, summed again in float64 by the row numbers' rules); damaged files, fp8
    # and files with findings in their header went to the per-file rules.
    alone = {"zero", "nan", "inf", "dup", "same_token", "aux_twice", "fp8", "extra",
             "truncated", "junk"}  # fmt: skip
    assert sorted(grouped) == sorted(set(corpus) - alone)


def test_small_groups_and_a_group_pass_that_fails_lose_nothing(
    corpus: dict[str, tuple[Path, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = [str(p) for p, _ in corpus.values()]
    monkeypatch.setattr(batched, "MAX_GROUP_BYTES", 40_000)  # a file or two a group
    _compare(batched.audit_files(paths), paths)
    calls = []
    real = batched.sound_layer_stats

    def failing(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:  # mid-group: two files done, the rest not
            raise MemoryError("injected")
        return real(*args)

    monkeypatch.setattr(batched, "MAX_GROUP_BYTES", 1 << 30)
    monkeypatch.setattr(batched, "sound_layer_stats", failing)
    got = batched.audit_files(paths)
    assert len(calls) >= 3
    _compare(got, paths)
