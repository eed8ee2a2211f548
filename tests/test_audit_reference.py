"""``vllm-hsfix audit --reference``: a sample recomputed with transformers and compared.

Files are written from a bf16 forward of the tiny dense verifier (what a correct vLLM
writes, up to kernel noise); one gets another file's rows, as vLLM 0.24.0's reads
from other blocks do. The measurement on real vLLM output is in ``tests/test_e2e.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

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
