"""``vllm-hsfix audit`` on single files: verdicts and reasons on files made to look like
what a broken vLLM writes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from support.hsfiles import A, H, T, hs_file, write_raw

from vllm_hsfix import hazards
from vllm_hsfix.audit import pipeline, reports, scan


def only(rep: reports.FileReport, code: str) -> reports.Problem:
    """The single problem with ``code`` (fails if there is none or several)."""
    found = [p for p in rep.problems if p.code == code]
    assert len(found) == 1, rep.problems
    return found[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_good_file_is_ok_and_described(tmp_path: Path, dtype: torch.dtype) -> None:
    path = hs_file(tmp_path / "good.safetensors", dtype=dtype)
    rep = scan.audit_file(path)
    assert rep.verdict == "ok", rep.problems
    assert rep.problems == []
    assert (rep.n_tokens, rep.n_aux, rep.hidden, rep.n_token_ids) == (T, A, H, T)
    assert rep.dtype == {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}[dtype]
    assert rep.bytes == path.stat().st_size
    assert (rep.zero_rows, rep.nan_count, rep.inf_count, rep.duplicate_rows) == (0, 0, 0, 0)
    assert [st.count for st in rep.layers] == [T] * A
    for st in rep.layers:  # |N(0, I_256)| is about sqrt(256) = 16
        assert st.mean_norm is not None and 15.0 < st.mean_norm < 17.0
        assert st.std_norm is not None and 0.3 < st.std_norm < 1.2


def test_bf16_norms_match_torch(tmp_path: Path) -> None:
    """The numpy bf16 widening must give the same numbers as torch's own conversion."""
    g = torch.Generator().manual_seed(7)
    hs = (torch.randn(T, A, H, generator=g) * torch.linspace(0.1, 30, T)[:, None, None]).to(
        torch.bfloat16
    )
    save_file({"hidden_states": hs, "token_ids": torch.arange(T)}, str(tmp_path / "x.safetensors"))
    rep = scan.audit_file(tmp_path / "x.safetensors")
    norms = hs.float().norm(dim=-1).double()
    for a, st in enumerate(rep.layers):
        assert st.mean_norm == pytest.approx(norms[:, a].mean().item(), rel=1e-5)
        assert st.median_norm == pytest.approx(norms[:, a].quantile(0.5).item(), rel=1e-5)
        assert st.max_norm == pytest.approx(norms[:, a].max().item(), rel=1e-5)
        assert st.min_norm == pytest.approx(norms[:, a].min().item(), rel=1e-5)


def test_zero_rows_are_corrupt(tmp_path: Path) -> None:
    def edit(hs: torch.Tensor, ids: torch.Tensor) -> None:
        hs[5, 1] = 0
        hs[40] = 0  # all three aux rows of one token
        hs[41, 2] = -0.0  # negative zero is zero too

    rep = scan.audit_file(hs_file(tmp_path / "z.safetensors", edit=edit))
    assert rep.verdict == "corrupt"
    assert rep.zero_rows == 5
    assert [st.zero_rows for st in rep.layers] == [1, 2, 2]
    assert [st.count for st in rep.layers] == [T - 1, T - 2, T - 2]
    detail = only(rep, "zero_rows").detail
    assert "5 of 192 rows are all zero" in detail and "first at token position 5" in detail


def test_rows_copied_from_other_tokens_are_suspect(tmp_path: Path) -> None:
    def edit(hs: torch.Tensor, ids: torch.Tensor) -> None:
        ids[:] = torch.arange(T)  # distinct token ids
        hs[20, 0] = hs[3, 0]
        hs[21, 0] = hs[3, 0]
        hs[50, 2] = hs[9, 2]
        hs[51, 1] = hs[51, 2]  # the same token in another layer: not a duplicate

    rep = scan.audit_file(hs_file(tmp_path / "d.safetensors", edit=edit))
    assert rep.verdict == "suspect"
    assert rep.duplicate_rows == 3
    assert [st.duplicate_rows for st in rep.layers] == [2, 0, 1]
    detail = only(rep, "duplicate_rows").detail
    assert "3 rows repeat" in detail and "[3, 20, 21]" in detail


def test_same_token_id_with_the_same_row_is_not_a_duplicate(tmp_path: Path) -> None:
    """An embedding-like layer gives one token id one vector wherever it stands."""

    def edit(hs: torch.Tensor, ids: torch.Tensor) -> None:
        ids[10] = ids[30] = 7
        hs[30, 0] = hs[10, 0]

    rep = scan.audit_file(hs_file(tmp_path / "same.safetensors", edit=edit))
    assert rep.verdict == "ok", rep.problems
    assert rep.duplicate_rows == 0


def test_nan_and_inf_are_corrupt(tmp_path: Path) -> None:
    def edit(hs: torch.Tensor, ids: torch.Tensor) -> None:
        hs[1, 1, 3] = float("nan")
        hs[1, 1, 4] = float("nan")
        hs[2, 2, 2] = float("inf")
        hs[60, 0, 0] = float("-inf")

    rep = scan.audit_file(hs_file(tmp_path / "n.safetensors", edit=edit))
    assert rep.verdict == "corrupt"
    assert (rep.nan_count, rep.inf_count) == (2, 2)
    assert [st.nonfinite_rows for st in rep.layers] == [1, 1, 1]
    assert only(rep, "nonfinite").detail == "2 NaN and 2 Inf values in 3 rows"


def test_underflow_and_overflow_are_not_mistaken_for_zero_or_inf(tmp_path: Path) -> None:
    """Squares of 1e-30 underflow and of 1e30 overflow in float32: neither row is zero
    or non-finite; the tiny one is a near-zero row (suspect)."""

    def edit(hs: torch.Tensor, ids: torch.Tensor) -> None:
        hs[3, 0] = 1e-30
        hs[4, 1] = 1e30

    rep = scan.audit_file(hs_file(tmp_path / "u.safetensors", dtype=torch.float32, edit=edit))
    assert (rep.zero_rows, rep.nan_count, rep.inf_count) == (0, 0, 0)
    assert rep.near_zero_rows == 1 and rep.layers[0].near_zero_rows == 1
    assert rep.layers[0].min_norm == pytest.approx(1e-30 * 16, rel=1e-5)
    assert rep.layers[1].max_norm == pytest.approx(1e30 * 16, rel=1e-5)
    assert rep.verdict == "suspect"
    assert rep.codes() == ["near_zero_rows"]


def test_token_count_mismatch_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    hs = torch.randn(T, A, H).to(torch.bfloat16)
    save_file({"hidden_states": hs, "token_ids": torch.arange(T - 3)}, str(path))
    rep = scan.audit_file(path)
    assert rep.verdict == "corrupt" and rep.token_mismatch is True
    assert only(rep, "token_mismatch").detail == f"{T - 3} token_ids for {T} hidden-state tokens"
    assert [st.count for st in rep.layers] == [T] * A  # the rows are still audited


@pytest.mark.parametrize(
    ("tensors", "code", "needle"),
    [
        # Unknown layouts and dtypes are "unsupported", not corrupt: test_audit_fp8.py.
        ({"hidden_states": torch.ones(4, 3, 8)}, "missing_key", "['token_ids']"),
        (
            {"hidden_states": torch.ones(0, 3, 8), "token_ids": torch.arange(0)},
            "empty",
            "shape [0, 3, 8]",
        ),
        (
            {"hidden_states": torch.ones(4, 0, 8), "token_ids": torch.arange(4)},
            "empty",
            "shape [4, 0, 8]",
        ),
    ],
)
def test_wrong_keys_dtypes_shapes_and_empty_are_corrupt(
    tmp_path: Path, tensors: dict[str, torch.Tensor], code: str, needle: str
) -> None:
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    rep = scan.audit_file(path)
    assert rep.verdict == "corrupt"
    assert code in rep.codes()
    assert needle in only(rep, code).detail


# Layouts no writer the audit knows makes: each has no rule, so it is not judged.
UNKNOWN_LAYOUTS = {
    "hidden-2d": ({"hidden_states": torch.ones(24, 256)}, "hidden_states shape [24, 256]"),
    "hidden-1d": ({"hidden_states": torch.ones(24)}, "hidden_states shape [24]"),
    "hidden-4d": ({"hidden_states": torch.ones(24, 3, 2, 8)}, "shape [24, 3, 2, 8]"),
    "ids-2d": ({"token_ids": torch.arange(24).reshape(24, 1)}, "token_ids shape [24, 1]"),
    "ids-0d": ({"token_ids": torch.tensor(7)}, "token_ids shape []"),
}


@pytest.mark.parametrize("name", sorted(UNKNOWN_LAYOUTS))
def test_a_layout_with_no_rule_is_unsupported_not_corrupt(tmp_path: Path, name: str) -> None:
    edit, needle = UNKNOWN_LAYOUTS[name]
    tensors = {"hidden_states": torch.randn(24, 3, 256), "token_ids": torch.arange(24), **edit}
    path = tmp_path / f"{name}.safetensors"
    save_file(tensors, str(path))
    rep = scan.audit_file(path)
    assert rep.verdict == "unsupported", rep.problems
    assert rep.codes() == ["unsupported_layout"] and needle in rep.reason()


def test_extra_tensor_is_suspect(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    hs = torch.randn(T, A, H)
    save_file(
        {"hidden_states": hs, "token_ids": torch.arange(T), "extra": hs[0].clone()}, str(path)
    )
    rep = scan.audit_file(path)
    assert rep.verdict == "suspect" and rep.codes() == ["extra_keys"]


def test_truncated_files_are_corrupt(tmp_path: Path) -> None:
    good = hs_file(tmp_path / "src.safetensors").read_bytes()
    cut_data = write_raw(tmp_path / "a.safetensors", good[:-1000])
    rep = scan.audit_file(cut_data)
    assert rep.verdict == "corrupt" and rep.codes() == ["truncated"]
    assert "(1000 missing)" in rep.problems[0].detail
    assert (rep.n_tokens, rep.n_aux, rep.hidden) == (T, A, H)  # the header still speaks
    assert rep.layers == []

    cut_header = write_raw(tmp_path / "b.safetensors", good[:40])
    rep = scan.audit_file(cut_header)
    assert rep.codes() == ["truncated"] and "inside the header" in rep.problems[0].detail

    write_raw(tmp_path / "c.safetensors.lock", b"")  # the writer may still be at it
    rep = scan.audit_file(write_raw(tmp_path / "c.safetensors", good[:-10]))
    assert rep.codes() == ["truncated"] and "writer may still be running" in rep.reason()


def test_trailing_bytes_and_bad_offsets_are_corrupt(tmp_path: Path) -> None:
    good = hs_file(tmp_path / "src.safetensors").read_bytes()
    rep = scan.audit_file(write_raw(tmp_path / "t.safetensors", good + b"\0" * 16))
    assert rep.verdict == "corrupt" and rep.codes() == ["trailing_bytes"]

    n = int.from_bytes(good[:8], "little")
    header = json.loads(good[8 : 8 + n])
    header["token_ids"]["data_offsets"][1] += 8  # does not match its shape any more
    raw = json.dumps(header).encode()
    bad = len(raw).to_bytes(8, "little") + raw + good[8 + n :]
    rep = scan.audit_file(write_raw(tmp_path / "o.safetensors", bad))
    assert rep.codes() == ["bad_header"] and "needs 512 bytes" in rep.reason()


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"", "only 0 bytes"),
        (b"abc", "only 3 bytes"),
        (b"this is a text file, not tensors\n" * 20, "header length"),
        (bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)), "header length"),
        ((20).to_bytes(8, "little") + b"[1, 2, 3]" + b" " * 11, "not a JSON object"),
        ((20).to_bytes(8, "little") + b"\xff" * 20, "not JSON"),
    ],
)
def test_non_safetensors_files_are_corrupt_not_crashes(
    tmp_path: Path, data: bytes, needle: str
) -> None:
    rep = scan.audit_file(write_raw(tmp_path / "junk.safetensors", data))
    assert rep.verdict == "corrupt"
    assert rep.codes() == ["not_safetensors"]
    assert needle in rep.problems[0].detail


def test_unreadable_path_is_corrupt(tmp_path: Path) -> None:
    link = tmp_path / "gone.safetensors"
    link.symlink_to(tmp_path / "missing-target")
    rep = scan.audit_file(link)
    assert rep.verdict == "corrupt" and rep.codes() == ["unreadable"]
    assert "No such file" in rep.reason()


def test_small_windows_give_the_same_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Findings must not depend on where the window edges fall."""

    def edit(hs: torch.Tensor, ids: torch.Tensor) -> None:
        ids[:] = torch.arange(len(ids))
        hs[7, 1] = 0
        hs[250, 2] = 0
        hs[299, 0] = hs[1, 0]  # copied across many windows
        hs[123, 2, 5] = float("nan")

    path = hs_file(tmp_path / "w.safetensors", tokens=300, hidden=96, edit=edit)
    default = scan.audit_file(path)
    monkeypatch.setattr(scan, "WINDOW_BYTES", 96 * 4 * 3 * 7)  # 7 tokens per window
    small = scan.audit_file(path)
    assert default.verdict == small.verdict == "corrupt"
    assert (small.zero_rows, small.duplicate_rows, small.nan_count) == (2, 1, 1)
    for a, b in zip(default.layers, small.layers, strict=True):
        assert a.count == b.count and a.mean_norm == pytest.approx(b.mean_norm, rel=1e-12)
    assert default.codes() == small.codes() == ["zero_rows", "nonfinite", "duplicate_rows"]


def test_every_signature_names_a_row_of_the_register() -> None:
    ids = {h.id for h in hazards.HAZARDS}
    assert set(reports.HAZARD_IDS) <= ids


def hazard_of(path: Path) -> dict[str, str]:
    rep = pipeline.check_file(path)
    return {p.code: p.hazard for p in rep.problems}


def test_fewer_rows_than_token_ids_is_prefix_cache_slicing(tmp_path: Path) -> None:
    f = tmp_path / "short.safetensors"
    save_file(
        {"hidden_states": torch.randn(1, 3, 32).bfloat16(), "token_ids": torch.arange(65)},
        str(f),
    )
    assert hazard_of(f) == {"token_mismatch": "prefix-cache-slicing"}
    longer = tmp_path / "long.safetensors"  # more rows than ids: not this hazard's mark
    save_file(
        {"hidden_states": torch.randn(9, 3, 32).bfloat16(), "token_ids": torch.arange(5)},
        str(longer),
    )
    assert hazard_of(longer) == {"token_mismatch": ""}


def test_a_truncated_file_is_torn_files(tmp_path: Path) -> None:
    full = hs_file(tmp_path / "full.safetensors", tokens=64)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    rep = pipeline.check_file(cut)
    assert {p.code: p.hazard for p in rep.problems}.get("truncated") == "torn-files"
    assert "hazard torn-files" in rep.reason()


def test_one_state_in_two_aux_slots_is_aux_final_layer_dropped(tmp_path: Path) -> None:
    def broadcast(hs: torch.Tensor, ids: torch.Tensor) -> None:
        hs[:, 2] = hs[:, 1]  # what 0.18-0.24 save for ids [k, num_hidden_layers]

    f = hs_file(tmp_path / "b.safetensors", tokens=20, edit=broadcast)
    rep = pipeline.check_file(f)
    assert rep.verdict == "corrupt"
    assert {p.code: p.hazard for p in rep.problems} == {
        "aux_layers_identical": "aux-final-layer-dropped"
    }
    assert "aux slots 1 and 2 hold identical rows at all 20" in rep.reason()
    ok = hs_file(tmp_path / "ok.safetensors", tokens=20)
    assert pipeline.check_file(ok).verdict == "ok"  # real layers never agree everywhere
