"""``vllm-hsfix audit --reference MODEL_DIR``: recompute a sample of files with a
transformers forward of the verifier and compare; the only module importing torch."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .decode import read_rows
from .format import BadFile

THRESHOLD = 0.2
NEEDS = ("torch", "transformers")


def missing_dependency() -> str | None:
    import importlib.util

    absent = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if absent:
        return (
            f"vllm-hsfix audit --reference needs {', '.join(absent)}, which "
            f"{'is' if len(absent) == 1 else 'are'} not installed here: "
            "pip install torch transformers"
        )
    return None


def sample(paths: list[str], spec: str) -> list[str]:
    """``spec`` is a fraction written with a decimal point (``0.1``; ``1.0`` is every
    file) or a count written as an integer (``20``); files are taken evenly spaced in
    sorted order, so a rerun checks the same ones."""
    value = float(spec)
    if value <= 0:
        raise ValueError(f"--sample must be positive, got {spec}")
    fraction = any(c in spec for c in ".eE") and value <= 1
    if any(c in spec for c in ".eE") and not fraction:
        raise ValueError(f"--sample {spec}: a fraction is at most 1.0, a count is an integer")
    n = round(value * len(paths)) if fraction else int(value)
    n = max(1, min(len(paths), n))
    ordered = sorted(paths)
    step = len(ordered) / n
    return [ordered[int(i * step)] for i in range(n)]


def load_model(model_dir: str | Path, dtype: str = "float32") -> Any:
    """The verifier in eval mode, by the class its config names (a multimodal
    checkpoint's text stack included), in fp32 or the checkpoint's own dtype."""
    import torch
    import transformers

    config = json.loads((Path(model_dir) / "config.json").read_text())
    arch = (config.get("architectures") or ["AutoModelForCausalLM"])[0]
    cls = getattr(transformers, arch, transformers.AutoModelForCausalLM)
    torch_dtype = torch.float32 if dtype == "float32" else "auto"
    return cls.from_pretrained(model_dir, dtype=torch_dtype).eval()


def num_layers(model: Any) -> int:
    """``num_hidden_layers`` of the (text) model."""
    return int(model.config.get_text_config().num_hidden_layers)


def decoder_layers(model: Any) -> Any:
    """The decoder layer stack (an ``nn.ModuleList`` of ``num_hidden_layers`` layers) of a
    causal LM, a multimodal checkpoint's text stack included."""
    import torch

    n = num_layers(model)
    found = [
        mod
        for name, mod in model.named_modules()
        if isinstance(mod, torch.nn.ModuleList) and name.endswith("layers") and len(mod) == n
    ]
    if len(found) != 1:
        raise ValueError(f"cannot tell the {n} decoder layers of {type(model).__name__} apart")
    return found[0]


def conventions(num_layers: int, aux_layers: Sequence[int]) -> dict[int, str]:
    """What each aux layer id (0..num_layers) is compared with, in words (vLLM's numbering)."""
    out = {}
    for k in aux_layers:
        if k == num_layers:
            out[k] = "last decoder layer output before the final norm (vLLM's convention)"
        else:
            out[k] = f"input of decoder layer {k} (transformers' hidden_states[{k}])"
    return out


def aux_rows(model: Any, ids: Any, aux_layers: Sequence[int]) -> Any:
    """The reference hidden states of token ids ``ids`` (1-D tensor), shaped as the
    connector saves them: [tokens, len(aux_layers), hidden], float32. Aux id k <
    num_hidden_layers is ``hidden_states[k]``; k == num_hidden_layers is the last decoder
    layer's output before the final norm (a forward hook), as vLLM saves it."""
    import torch

    n = num_layers(model)
    bad = [k for k in aux_layers if not 0 <= k <= n]
    if bad:
        raise ValueError(f"aux layer ids {bad} out of range: the model has {n} decoder layers")
    last: list[Any] = []

    def keep(_mod: Any, _args: Any, out: Any) -> None:
        last.append(out[0] if isinstance(out, tuple) else out)

    hook = decoder_layers(model)[n - 1].register_forward_hook(keep) if n in aux_layers else None
    try:
        with torch.no_grad():
            hs = model(ids[None, :].long(), output_hidden_states=True).hidden_states
    finally:
        if hook is not None:
            hook.remove()
    if len(hs) != n + 1:
        raise ValueError(f"{len(hs)} hidden states for {n} decoder layers: cannot number them")
    return torch.stack([(last[-1] if k == n else hs[k])[0].float() for k in aux_layers], dim=1)


def row_errors(got: Any, want: Any) -> Any:
    """Relative L2 error of every saved row (token x aux layer) against the reference;
    NaN where the saved row holds NaN."""
    return (got.float() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)


def compare_file(model: Any, path: str, aux_layers: list[int], model_dir: str) -> str | None:
    """What is wrong with ``path``'s rows against the reference forward (None: nothing)."""
    import torch

    try:
        values, token_ids, _ = read_rows(path)
    except (BadFile, OSError, ValueError) as exc:
        why = exc.detail if isinstance(exc, BadFile) else repr(exc)
        return f"cannot compare with the reference: {why}"
    got, ids = torch.from_numpy(values), torch.from_numpy(token_ids.astype("int64"))
    if got.shape[0] != len(ids) or got.shape[1] != len(aux_layers):
        return (
            f"cannot compare with the reference: hidden_states {tuple(got.shape)} does not "
            f"fit {len(ids)} tokens x {len(aux_layers)} aux layers {aux_layers}"
        )
    err = row_errors(got, aux_rows(model, ids, aux_layers)).nan_to_num(nan=float("inf"))
    bad = err >= THRESHOLD
    if not bool(bad.any()):
        return None
    pos, aux = (int(v) for v in bad.nonzero()[0])
    return (
        f"{int(bad.sum())} of {err.numel()} rows differ from a transformers forward of "
        f"{model_dir} (relative L2 >= {THRESHOLD}; first at token position {pos}, aux "
        f"slot {aux} (id {aux_layers[aux]}); worst {float(err.max()):.2f})"
    )


def check(
    paths: list[str],
    model_dir: str,
    aux_layers: list[int],
    spec: str,
    dtype: str = "float32",
    tick: Callable[[int], None] | None = None,
) -> tuple[dict[str, str], dict[str, Any]]:
    """Compare a sample of ``paths`` with the reference: what is wrong with each file
    that disagrees, by path, and a summary. ``tick(1)`` after each file (progress)."""
    t0 = time.perf_counter()
    model = load_model(model_dir, dtype)
    load_s = time.perf_counter() - t0
    n_layers = num_layers(model)
    bad = [k for k in aux_layers if not 0 <= k <= n_layers]
    if bad:  # the arguments, not the files, are wrong: a usage error (exit 2)
        raise RuntimeError(
            f"--aux-layers {bad}: {model_dir} has {n_layers} decoder layers (aux ids 0-"
            f"{n_layers}; {n_layers} is the last layer's output before the final norm)"
        )
    rules = conventions(n_layers, aux_layers)
    chosen = sample(paths, spec)
    wrong = {}
    t1 = time.perf_counter()
    for p in chosen:
        problem = compare_file(model, p, aux_layers, model_dir)
        if problem is not None:
            wrong[p] = problem
        if tick:
            tick(1)
    return wrong, {
        "model": str(model_dir),
        "aux_layers": aux_layers,
        # What each aux id was compared with: "4": "last decoder layer output before ..."
        "conventions": {str(k): v for k, v in rules.items()},
        "dtype": dtype,
        "threshold": THRESHOLD,
        "files_compared": len(chosen),
        "files_wrong": len(wrong),
        "model_load_s": round(load_s, 3),
        "seconds_per_file": round((time.perf_counter() - t1) / max(1, len(chosen)), 4),
    }
