"""Hidden states as speculators' pipeline writes them, from a transformers forward: aux id
k < num_hidden_layers is ``hidden_states[k]``; k == num_hidden_layers is the last layer's
output before the final norm (or after it, ``last="post"``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from support import npfiles

TEMPLATE = npfiles.TEMPLATE  # a chat template's first tokens: a shared prefix
AUX = [1, 2, 3, 4]  # the tiny hybrid has 4 layers: 4 is speculators' appended last layer


class NoEvent:
    """The CUDA event the writers wait on: the rows here are already on the CPU."""

    def synchronize(self) -> None:
        pass


def load(model_dir: Path) -> Any:
    import transformers

    arch = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(model_dir, dtype=torch.float32).eval()


def prompts(n: int, seed: int = 5) -> list[list[int]]:
    """``n`` prompts: the template, then a random tail of 8-20 tokens."""
    g = torch.Generator().manual_seed(seed)
    return [
        TEMPLATE
        + torch.randint(
            20, 500, (int(torch.randint(8, 21, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(n)
    ]


def rows(model: Any, ids: list[int], aux: list[int] = AUX, last: str = "pre") -> torch.Tensor:
    """float32 ``[tokens, len(aux), hidden]`` for ``ids``, aux ids as described above."""
    n = model.config.get_text_config().num_hidden_layers
    layers = (
        model.model.language_model.layers
        if hasattr(model.model, "language_model")
        else model.model.layers
    )
    assert len(layers) == n
    seen: list[torch.Tensor] = []
    hook = layers[n - 1].register_forward_hook(
        lambda _m, _a, out: seen.append(out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.no_grad():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    picked = [seen[-1] if (k == n and last == "pre") else hs[k] for k in aux]
    return torch.stack([h[0].float() for h in picked], dim=1).contiguous()


def rel_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Relative L2 error of every row (token x aux slot); inf for NaN or another shape."""
    if got.shape != want.shape:
        return torch.full(want.shape[:2], float("inf"))
    err = (got.float() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)
    return err.nan_to_num(nan=float("inf"))


def write_bf16(path: Path, hs: torch.Tensor, ids: list[int]) -> Path:
    """The file vLLM's connector writes (bf16 rows, as the model runs)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )

    tensors = {"hidden_states": hs.to(torch.bfloat16), "token_ids": torch.tensor(ids)}
    ExampleHiddenStatesConnector._write_tensors(tensors, NoEvent(), str(path), None)
    return path


def write_fp8(path: Path, hs: torch.Tensor, ids: list[int]) -> Path:
    """The file hs-connectors' fp8 connector writes from the same bf16 rows."""
    from hs_connectors.fp8_hidden_states_connector import FP8HiddenStatesConnector

    tensors = {"hidden_states": hs.to(torch.bfloat16), "token_ids": torch.tensor(ids)}
    FP8HiddenStatesConnector._write_tensors(tensors, NoEvent(), str(path), None)
    return path


def dequantized(path: Path) -> torch.Tensor:
    """An fp8 file's rows as the consumer (hs-connectors' FP8Transfer) computes them,
    in float32: torch's own float8_e4m3fn conversion times the scales."""
    from safetensors.torch import load_file

    data = load_file(str(path))
    return data["hidden_states"].float() * data["hidden_states_scales"].float()
