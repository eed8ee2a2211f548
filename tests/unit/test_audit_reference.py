"""``vllm-hsfix audit --reference``: a sample recomputed with transformers and compared,
on files from a bf16 forward of the tiny models (one with another file's rows)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import hsrows

from vllm_hsfix.audit import reference
from vllm_hsfix.cli import main

AUX = [1, 3]


def written(model_dir: Path, out: Path, n: int = 4) -> list[Path]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(3)
    paths = []
    for i in range(n):
        ids = torch.randint(4, 500, (20 + 7 * i,), generator=g)
        with torch.no_grad():
            hs = model(ids[None], output_hidden_states=True).hidden_states
        rows = torch.stack([hs[k][0] for k in AUX], dim=1).contiguous()
        path = out / f"{i}.safetensors"
        save_file({"hidden_states": rows, "token_ids": ids}, str(path))
        paths.append(path)
    return paths


def test_reference_flags_the_file_with_other_rows_and_only_it(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = written(tiny_models["dense"], tmp_path)
    from safetensors.torch import load_file

    a, b = load_file(str(paths[1])), load_file(str(paths[2]))
    a["hidden_states"] = b["hidden_states"][: len(a["token_ids"])].clone()
    save_file(a, str(paths[1]))
    code = main(
        [
            "audit",
            str(tmp_path),
            "--json",
            "--reference",
            str(tiny_models["dense"]),
            "--aux-layers",
            "1,3",
            "--sample",
            "4",
        ]
    )
    out = capsys.readouterr()
    doc = json.loads(out.out)
    verdicts = {Path(f["path"]).name: f["verdict"] for f in doc["files"]}
    assert code == 1 and verdicts == {
        "0.safetensors": "ok",
        "1.safetensors": "corrupt",
        "2.safetensors": "ok",
        "3.safetensors": "ok",
    }, verdicts
    bad = next(f for f in doc["files"] if f["path"].endswith("1.safetensors"))
    assert [p["code"] for p in bad["problems"]] == ["reference_mismatch"]
    assert doc["dataset"]["reference"]["files_compared"] == 4
    assert "s per file" in out.err  # the cost is printed


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "--reference needs --aux-layers"),
        (["--aux-layers", "1", "--sample", "-1"], "--sample must be positive"),
    ],
)
def test_reference_usage_errors_are_exit_2_before_any_work(
    tiny_models: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    written(tiny_models["dense"], tmp_path, n=1)
    code = main(["audit", str(tmp_path), "--reference", str(tiny_models["dense"]), *extra])
    assert code == 2 and message in capsys.readouterr().err


def test_reference_without_a_model_dir_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "x.safetensors").write_bytes(b"")
    code = main(
        ["audit", str(tmp_path), "--reference", str(tmp_path / "nope"), "--aux-layers", "1"]
    )
    assert code == 2 and "holds no config.json" in capsys.readouterr().err


def last_layer_files(model_dir: Path, out: Path, last: str) -> list[tuple[list[int], Path]]:
    """Files speculators' ``file`` backend writes with aux ids 1-4 on the 4-layer hybrid, by
    vLLM's writer, with ``last`` "pre" (what vLLM saves for id 4) or "post"."""
    model = hsrows.load(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [
        (
            ids,
            hsrows.write_bf16(out / f"hs_{i}.safetensors", hsrows.rows(model, ids, last=last), ids),
        )
        for i, ids in enumerate(hsrows.prompts(3, seed=11))
    ]


def audit_last_layer(model_dir: Path, root: Path, capsys: pytest.CaptureFixture[str]) -> Any:
    aux = ",".join(map(str, hsrows.AUX))
    capsys.readouterr()  # what importing vLLM's writer printed is not the report
    code = main(
        [
            "audit",
            str(root),
            "--json",
            "--reference",
            str(model_dir),
            "--aux-layers",
            aux,
            "--sample",
            "3",
        ]
    )
    out = capsys.readouterr()
    return code, json.loads(out.out), out.err


def test_reference_aux_id_num_hidden_layers_is_the_pre_norm_last_layer(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Right files (vLLM's pre-norm convention for aux id 4) are ok and the report names the
    convention; compared with the post-norm ``hidden_states[4]`` they would be corrupt."""
    model_dir = tiny_models["hybrid"]
    files = last_layer_files(model_dir, tmp_path, "pre")
    code, doc, err = audit_last_layer(model_dir, tmp_path, capsys)
    assert code == 0 and {f["verdict"] for f in doc["files"]} == {"ok"}, doc["files"]
    assert (
        "reference: aux slot 3 (id 4) = last decoder layer output before the final norm (vLLM's "
        in err
    )
    assert (
        "reference: aux slot 0 (id 1) = input of decoder layer 1 (transformers' hidden_states[1])"
        in err
    )
    conv = doc["dataset"]["reference"]["conventions"]
    assert conv["4"] == "last decoder layer output before the final norm (vLLM's convention)"

    # Every right row of aux id 4 against the post-norm state: far off.
    model = hsrows.load(model_dir)
    for ids, path in files:
        saved = load_file(str(path))["hidden_states"].float()
        post = hsrows.rows(model, ids, last="post")
        err4 = (saved[:, 3] - post[:, 3]).norm(dim=-1) / post[:, 3].norm(dim=-1)
        assert bool((err4 >= reference.THRESHOLD).all()), err4
        assert torch.allclose(saved[:, :3], post[:, :3], rtol=0.02, atol=0.02)


def test_reference_post_norm_last_layer_rows_are_corrupt(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Post-norm rows in aux id 4's slot: exactly that slot's rows are wrong, in every file."""
    files = last_layer_files(tiny_models["hybrid"], tmp_path, "post")
    code, doc, _ = audit_last_layer(tiny_models["hybrid"], tmp_path, capsys)
    assert code == 1 and {f["verdict"] for f in doc["files"]} == {"corrupt"}
    for ids, path in files:
        f = next(f for f in doc["files"] if f["path"] == str(path))
        assert [p["code"] for p in f["problems"]] == ["reference_mismatch"]
        n = len(ids)
        detail = f["problems"][0]["detail"]
        assert detail.startswith(f"{n} of {4 * n} rows differ"), detail
        assert "first at token position 0, aux slot 3 (id 4)" in detail


def test_reference_aux_id_past_the_last_layer_is_a_usage_error(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    written(tiny_models["dense"], tmp_path, n=1)
    args = ["--reference", str(tiny_models["hybrid"]), "--aux-layers", "1,5"]
    code = main(["audit", str(tmp_path), *args])
    assert code == 2 and "--aux-layers [5]" in capsys.readouterr().err


def test_sample_one_point_zero_is_every_file_and_an_integer_a_count() -> None:
    """``--sample 1.0`` is every file: a fraction has a decimal point, a count is an integer."""
    paths = [f"f{i:02d}" for i in range(10)]
    assert reference.sample(paths, "1.0") == paths
    assert reference.sample(paths, "0.5") == paths[::2]
    assert reference.sample(paths, "1") == ["f00"]
    assert reference.sample(paths, "3") == ["f00", "f03", "f06"]
    with pytest.raises(ValueError, match=r"at most 1\.0"):
        reference.sample(paths, "2.5")
