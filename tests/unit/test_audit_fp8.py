"""``vllm-hsfix audit`` on the files speculators' ``fp8`` backend writes (float8_e4m3fn
with a per-token fp32 scale), written by the real writers from a transformers forward of
the tiny hybrid; read without de-quantization every right file would look corrupt.
Expected values come from torch and from how each file was damaged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip(
    "hs_connectors.fp8_hidden_states_connector",
    reason="hs-connectors is not installed (the speculators overlay of the test env)",
)

from safetensors.torch import load_file, save_file
from support import hsrows

from vllm_hsfix.audit import command, parallel, scan
from vllm_hsfix.audit.decode import fp8_e4m3fn_table

N = 6  # prompts sharing the template prefix


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> Any:
    return hsrows.load(tiny_models["hybrid"])


@pytest.fixture(scope="module")
def batch(model: Any) -> list[tuple[list[int], torch.Tensor]]:
    """Each prompt's token ids and right rows (pre-norm last layer, as vLLM saves)."""
    return [(ids, hsrows.rows(model, ids)) for ids in hsrows.prompts(N)]


def audit_json(*args: str) -> tuple[int, dict[str, Any], str]:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = command.main([*args, "--json", "--no-progress"])
    return code, json.loads(out.getvalue()), err.getvalue()


def audit_reference(path: Path, model: Path, n: int) -> tuple[int, dict[str, Any], str]:
    """``audit --reference`` of ``path`` on ``n`` files, aux layers ``hsrows.AUX``."""
    aux = ",".join(map(str, hsrows.AUX))
    return audit_json(str(path), "--reference", str(model), "--aux-layers", aux, "--sample", str(n))


def by_name(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {Path(f["path"]).name: f for f in doc["files"]}


def test_the_fp8_table_is_torchs_float8_e4m3fn() -> None:
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    got = fp8_e4m3fn_table()
    assert got.dtype == np.float32
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan) and np.flatnonzero(nan).tolist() == [0x7F, 0xFF]
    assert np.array_equal(got[~nan], want[~nan])
    assert np.array_equal(np.signbit(got[~nan]), np.signbit(want[~nan]))  # -0.0 at 0x80
    assert got[0x7E] == 448.0 and got[0x01] == 2.0**-9  # largest; smallest subnormal


def test_right_fp8_and_bf16_files_from_the_real_writers_are_ok(
    tiny_models: dict[str, Path],
    batch: list[tuple[list[int], torch.Tensor]],
    tmp_path: Path,
) -> None:
    for kind, write in (("fp8", hsrows.write_fp8), ("plain", hsrows.write_bf16)):
        root = tmp_path / kind
        root.mkdir()
        for i, (ids, hs) in enumerate(batch):
            write(root / f"hs_{i}.safetensors", hs, ids)
        code, doc, err = audit_reference(root, tiny_models["hybrid"], N)
        files = by_name(doc)
        assert code == 0, (kind, {n: f["problems"] for n, f in files.items()})
        assert {f["verdict"] for f in files.values()} == {"ok"}
        assert {f["format"] for f in files.values()} == {kind}
        assert doc["totals"]["unsupported"] == 0 and doc["unsupported"] == []
        assert doc["dataset"]["prefix"]["files_checked"] == N
        assert doc["dataset"]["prefix"]["files_flagged"] == 0
        assert doc["dataset"]["reference"]["files_wrong"] == 0
        assert "aux slot 3 (id 4) = last decoder layer output before the final norm" in err
        assert f"format {kind}: {N} files" in err  # the text summary went to stderr
    # The statistics are of de-quantized values: torch's float8 conversion x the scales.
    f0 = by_name(audit_json(str(tmp_path / "fp8" / "hs_0.safetensors"))[1])["hs_0.safetensors"]
    want = hsrows.dequantized(tmp_path / "fp8" / "hs_0.safetensors").norm(dim=-1)
    for st in f0["layers"]:
        assert st["median_norm"] == pytest.approx(float(want[:, st["aux"]].median()), rel=1e-5)
        assert st["max_norm"] == pytest.approx(float(want[:, st["aux"]].max()), rel=1e-5)
    assert f0["dtype"] == "F8_E4M3" and f0["n_aux"] == len(hsrows.AUX)


def test_wrong_fp8_files_are_corrupt(
    tiny_models: dict[str, Path],
    model: Any,
    batch: list[tuple[list[int], torch.Tensor]],
    tmp_path: Path,
) -> None:
    """Each damage on a file that is otherwise right; the right files stay ok. Every
    file is also recomputed (``--reference``): it flags each damaged file again."""
    for i, (ids, hs) in enumerate(batch):
        hsrows.write_fp8(tmp_path / f"ok_{i}.safetensors", hs, ids)
    ids, hs = batch[0]
    other_ids, other = batch[1]

    zero = hs.clone()
    zero[3, 1] = 0.0  # one aux row of one token all zero
    hsrows.write_fp8(tmp_path / "zero.safetensors", zero, ids)

    nan = hs.clone()
    nan[len(ids) - 2, 2, 5] = float("nan")  # the writer's scale for that token is NaN
    hsrows.write_fp8(tmp_path / "nan.safetensors", nan, ids)

    # Rows of another prompt at a position inside the shared template prefix.
    swapped = hs.clone()
    swapped[2] = other[len(other_ids) - 1]
    hsrows.write_fp8(tmp_path / "swapped.safetensors", swapped, ids)

    # Past the prefixes any file shares only the reference can tell: a prompt of its
    # own whose last token's values are permuted (same norms and scale, no repeat).
    long_ids = hsrows.TEMPLATE + list(range(100, 120))
    permuted = hsrows.rows(model, long_ids)
    g = torch.Generator().manual_seed(0)
    permuted[-1] = permuted[-1][:, torch.randperm(hs.shape[-1], generator=g)]
    hsrows.write_fp8(tmp_path / "permuted.safetensors", permuted, long_ids)

    whole = (tmp_path / "ok_0.safetensors").read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(whole[:-300])

    code, doc, _ = audit_reference(tmp_path, tiny_models["hybrid"], 100)
    files = by_name(doc)
    verdicts = {n: f["verdict"] for n, f in files.items()}
    codes = {n: [p["code"] for p in f["problems"]] for n, f in files.items()}
    assert code == 1
    assert verdicts == {
        **{f"ok_{i}.safetensors": "ok" for i in range(N)},
        "zero.safetensors": "corrupt",
        "nan.safetensors": "corrupt",
        "swapped.safetensors": "corrupt",
        "permuted.safetensors": "corrupt",
        "truncated.safetensors": "corrupt",
    }, codes
    assert codes["zero.safetensors"][0] == "zero_rows"
    assert files["zero.safetensors"]["problems"][0]["detail"].startswith("1 of ")
    assert {"bad_scales", "nonfinite"} <= set(codes["nan.safetensors"])
    assert codes["swapped.safetensors"] == ["prefix_mismatch", "reference_mismatch"]
    assert "row 2 " in files["swapped.safetensors"]["problems"][0]["detail"]
    assert codes["permuted.safetensors"] == ["reference_mismatch"]
    assert "first at token position 25" in files["permuted.safetensors"]["problems"][0]["detail"]
    assert codes["truncated.safetensors"][0] == "truncated"
    assert all(codes[f"ok_{i}.safetensors"] == [] for i in range(N))
    assert sorted(Path(p).name for p in doc["regenerate"]) == sorted(
        n for n, v in verdicts.items() if v == "corrupt"
    )


@pytest.mark.parametrize("hidden", [15, 16])  # odd and even row widths
def test_fp8_statistics_are_of_torchs_dequantized_values(hidden: int, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(hidden)
    hs = torch.randn(40, 3, hidden, generator=g) * torch.logspace(-3, 2, 40)[:, None, None]
    path = hsrows.write_fp8(tmp_path / "r.safetensors", hs, list(range(40)))
    rep = scan.audit_file(path)
    assert rep.verdict == "ok" and rep.format == "fp8", rep.problems
    want = hsrows.dequantized(path).double().norm(dim=-1)
    for st in rep.layers:
        col = want[:, st.aux]
        assert st.mean_norm == pytest.approx(float(col.mean()), rel=1e-5)
        assert st.min_norm == pytest.approx(float(col.min()), rel=1e-5)
        assert st.max_norm == pytest.approx(float(col.max()), rel=1e-5)

    tensors = load_file(str(path))
    tensors["hidden_states_scales"][7] *= -1  # a sign the writer never gives a scale
    save_file(tensors, str(path))
    rep = scan.audit_file(path)
    assert rep.verdict == "corrupt" and rep.codes() == ["bad_scales"]
    assert "1 of 40 hidden_states_scales" in rep.reason() and "position 7" in rep.reason()


def test_fp8_files_through_the_worker_batches_and_state(
    batch: list[tuple[list[int], torch.Tensor]], tmp_path: Path
) -> None:
    """``parallel.run_batch`` judges fp8 files as ``audit_file`` does, and ``--state`` keeps
    their sketches, so a rerun still cross-checks their prefixes."""
    root = tmp_path / "hs"
    root.mkdir()
    paths = []
    for i, (ids, hs) in enumerate(batch):
        if i == 2:
            hs = hs.clone()
            hs[1] = batch[3][1][-1]  # another prompt's rows at shared position 1
        paths.append(hsrows.write_fp8(root / f"hs_{i}.safetensors", hs, ids))
    reps = parallel.run_batch([str(p) for p in paths])
    assert [r.format for r in reps] == ["fp8"] * N and [r.verdict for r in reps] == ["ok"] * N
    assert [r.to_dict() for r in reps] == [
        {**scan.audit_file(p).to_dict(), "seconds": r.seconds}
        for p, r in zip(paths, reps, strict=True)
    ]
    state = tmp_path / "audit.state"
    for run in range(2):
        code, doc, _ = audit_json(str(root), "--state", str(state), "--workers", "2")
        assert code == 1 and doc["totals"]["reused"] == (N if run else 0)
        assert by_name(doc)["hs_2.safetensors"]["verdict"] == "corrupt"
        assert doc["dataset"]["prefix"]["files_flagged"] == 1
        assert {f["format"] for f in doc["files"]} == {"fp8"}


def _fp8_tensors(n: int = 5) -> dict[str, torch.Tensor]:
    hs = torch.randn(n, 3, 16)
    scale = hs.abs().amax(dim=(1, 2), keepdim=True) / 448
    return {
        "hidden_states": (hs / scale).to(torch.float8_e4m3fn),
        "hidden_states_scales": scale,
        "token_ids": torch.arange(n),
    }


E5M2 = {"hidden_states": lambda t: t.float().to(torch.float8_e5m2)}
ROW_SCALES = {"hidden_states_scales": lambda t: t.expand(-1, 3, 1).contiguous()}
I32_ROWS = {"hidden_states": lambda t: t.float().int(), "hidden_states_scales": None}
OTHER_KEYS = {"hidden_states": None, "hidden": lambda t: torch.zeros(5, 3, 8)}


@pytest.mark.parametrize(
    ("name", "edit", "code", "needle"),
    [
        ("e5m2", E5M2, "unsupported_layout", "F8_E5M2"),
        ("noscale", {"hidden_states_scales": None}, "unsupported_dtype", "without hidden_states_"),
        ("f16scale", {"hidden_states_scales": lambda t: t.half()}, "unsupported_dtype", "F16"),
        ("rowscale", ROW_SCALES, "unsupported_layout", "[5, 3, 1]"),
        ("i32rows", I32_ROWS, "unsupported_dtype", "hidden_states dtype I32"),
        ("i32ids", {"token_ids": lambda t: t.int()}, "unsupported_dtype", "token_ids dtype I32"),
        ("otherkeys", OTHER_KEYS, "unsupported_layout", "not a layout"),
    ],
)
def test_formats_the_audit_does_not_know_are_unsupported_not_corrupt(
    tmp_path: Path, name: str, edit: dict[str, Any], code: str, needle: str
) -> None:
    tensors = _fp8_tensors()
    for key, fn in edit.items():
        if fn is None:
            del tensors[key]
        else:
            tensors[key] = fn(tensors.get(key, tensors["token_ids"]))
    path = tmp_path / f"{name}.safetensors"
    save_file(tensors, str(path))
    rep = scan.audit_file(path)
    assert rep.verdict == "unsupported" and code in rep.codes(), rep.problems
    assert needle in rep.reason()
    if name == "i32ids":  # the rows are known: still read, for damage they may show
        assert rep.format == "fp8" and len(rep.layers) == 3
    else:
        assert rep.format is None and rep.layers == []


def test_unsupported_files_are_listed_apart_and_exit_0(
    batch: list[tuple[list[int], torch.Tensor]], tmp_path: Path
) -> None:
    ids, hs = batch[0]
    hsrows.write_fp8(tmp_path / "right.safetensors", hs, ids)
    raw = (tmp_path / "right.safetensors").read_bytes()
    # A dtype unknown to the audit (same width, so the header stays consistent).
    assert raw.count(b'"F8_E4M3"') == 1
    (tmp_path / "e8m0.safetensors").write_bytes(raw.replace(b'"F8_E4M3"', b'"F8_E8M0"'))
    tensors = load_file(str(tmp_path / "right.safetensors"))
    del tensors["hidden_states_scales"]
    save_file(tensors, str(tmp_path / "noscale.safetensors"))

    code, doc, err = audit_json(str(tmp_path))
    verdicts = {n: f["verdict"] for n, f in by_name(doc).items()}
    assert code == 0, verdicts
    assert verdicts == {
        "right.safetensors": "ok",
        "e8m0.safetensors": "unsupported",
        "noscale.safetensors": "unsupported",
    }
    assert by_name(doc)["e8m0.safetensors"]["problems"][0]["code"] == "unsupported_dtype"
    assert doc["totals"]["unsupported"] == 2 and doc["totals"]["corrupt"] == 0
    assert sorted(Path(p).name for p in doc["unsupported"]) == [
        "e8m0.safetensors",
        "noscale.safetensors",
    ]
    assert "unsupported 2" in err and "not judged: 2 files" in err
    listed = tmp_path / "unsupported.txt"
    e8m0 = tmp_path / "e8m0.safetensors"
    assert command.main([str(e8m0), "--list", "unsupported", str(listed), "--no-progress"]) == 0
    assert listed.read_text() == f"{e8m0}\n"
    # Damage the audit can see whatever the format is still damage: exit 1.
    cut = tmp_path / "cut" / "noscale.safetensors"
    cut.parent.mkdir()
    cut.write_bytes((tmp_path / "noscale.safetensors").read_bytes()[:-50])
    code, doc, _ = audit_json(str(cut))
    assert code == 1 and doc["files"][0]["verdict"] == "corrupt"
    assert [p["code"] for p in doc["files"][0]["problems"]] == ["truncated", "unsupported_dtype"]
