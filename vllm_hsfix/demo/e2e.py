"""End-to-end: real vLLM writes hidden states; compare them with a transformers reference.

Each case runs ``_case.py`` in a fresh interpreter (so whether the fix is active is
decided only by vLLM's plugin loading and the environment, as in a user's job), with
the CPU stand-ins plugin on ``PYTHONPATH`` when there is no GPU. The saved
``hidden_states`` [tokens, n_aux, hidden] are compared row by row (token x aux layer)
with an fp32 ``transformers`` forward (``output_hidden_states=True``; aux id k is
``hidden_states[k]``): relative L2 error under 0.1 is a correct row (measured: right
rows 0.01-0.06, wrong rows 1.0 for zeros up to ~2 for other memory).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import cpu_standins, tiny_model

THRESHOLD = 0.1
CASE_SCRIPT = Path(__file__).with_name("_case.py")


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # hybrid | dense
    aux_ids: tuple[int, ...]
    mp: bool  # worker in its own process (distributed_executor_backend="mp")
    note: str


CASES = {
    c.name: c
    for c in (
        Case("hybrid-mp", "hybrid", (1, 2, 3), True, "hybrid, worker in its own process"),
        Case(
            "hybrid-1aux",
            "hybrid",
            (2,),
            False,
            "hybrid, in-process, hidden-states group not the smallest",
        ),
        Case("dense-mp", "dense", (1, 2, 3), True, "dense control, worker in its own process"),
    )
}


def prompts(seed: int = 0, count: int = 4) -> list[list[int]]:
    """Token-id prompts of mixed lengths (several KV blocks each, partial last blocks)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = [(37, 64, 101, 150)[i % 4] + 7 * (i // 4) for i in range(count)]
    return [torch.randint(4, tiny_model.VOCAB, (n,), generator=gen).tolist() for n in lengths]


@dataclass
class Result:
    case: str
    patched: bool
    vllm: str
    ok_run: bool
    rows: int = 0
    rows_correct: int = 0
    rows_zero: int = 0
    max_rel_err: float = 0.0
    rows_nan: int = 0
    mismatched: list[str] = field(default_factory=list)
    block_sizes: list[dict[str, Any]] = field(default_factory=list)
    statuses: list[dict[str, Any]] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    run: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def correct_pct(self) -> float:
        return 100.0 * self.rows_correct / self.rows if self.rows else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "correct_pct": round(self.correct_pct, 1)}


_REFERENCE: dict[tuple[str, tuple[int, ...]], list[Any]] = {}


def reference(model_path: Path, batch: list[list[int]], aux_ids: tuple[int, ...]) -> list[Any]:
    key = (str(model_path), aux_ids)
    if key not in _REFERENCE:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        model.eval()
        out = []
        with torch.no_grad():
            for ids in batch:
                hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
                out.append(torch.stack([hs[k][0] for k in aux_ids], dim=1))
        _REFERENCE[key] = out
    return _REFERENCE[key]


def compare(saved: list[dict[str, Any]], ref: list[Any], batch: list[list[int]]) -> dict[str, Any]:
    """Row-by-row comparison; a NaN row or a file for the wrong tokens counts as wrong."""
    rows = correct = zero = nan = 0
    worst = 0.0
    mismatched: list[str] = []
    for i, (data, want, ids) in enumerate(zip(saved, ref, batch, strict=True)):
        got = data["hidden_states"].float()
        if data["token_ids"].tolist() != ids or got.shape != want.shape:
            rows += want.shape[0] * want.shape[1]
            mismatched.append(
                f"request {i}: saved {tuple(got.shape)} for {len(data['token_ids'])} token ids, "
                f"expected {tuple(want.shape)}"
            )
            continue
        err = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)
        rows += err.numel()
        correct += int((err < THRESHOLD).sum())
        zero += int((got.abs().amax(dim=-1) == 0).sum())
        nan += int(err.isnan().sum())
        worst = max(worst, float(err.nan_to_num(nan=float("inf")).max()))
    return {
        "rows": rows,
        "rows_correct": correct,
        "rows_zero": zero,
        "rows_nan": nan,
        "max_rel_err": worst,
        "mismatched": mismatched,
    }


def plugin_dir(root: Path) -> Path:
    return Path(cpu_standins.write_plugin_dir(str(root / "cpu-standins-plugin")))


def run_case(
    case: Case,
    *,
    patched: bool,
    workdir: Path,
    models: Path,
    extra_env: dict[str, str] | None = None,
    count: int = 4,
) -> Result:
    """One vLLM run of ``case`` with the fix active (plugin) or disabled."""
    import torch
    from safetensors.torch import load_file

    from .. import detect

    inst = detect.detect()
    model = tiny_model.build(models / case.kind, case.kind)
    batch = prompts(count=count)
    tag = f"{case.name}-{'patched' if patched else 'unpatched'}"
    out_dir = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir=workdir))
    status_dir, observe_dir = out_dir / "status", out_dir / "observe"
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        VLLM_HSFIX_STATUS_DIR=str(status_dir),
        HSFIX_DEMO_OBSERVE_DIR=str(observe_dir),
        TOKENIZERS_PARALLELISM="false",
    )
    if not torch.cuda.is_available():
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(plugin_dir(workdir)), env.get("PYTHONPATH", "")) if p
        )
    if patched:
        env.pop("VLLM_HSFIX_DISABLE", None)
    else:
        env["VLLM_HSFIX_DISABLE"] = "1"
    env.update(extra_env or {})
    args = {
        "model": str(model),
        "aux_ids": list(case.aux_ids),
        "mp": case.mp,
        "hybrid": case.kind == "hybrid",
        "out": str(out_dir / "hs"),
        "prompts": batch,
    }
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(CASE_SCRIPT), json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    result = Result(
        case.name,
        patched,
        inst.version or "?",
        ok_run=False,
        wall_s=round(time.monotonic() - t0, 1),
    )
    (out_dir / "run.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    line = next(
        (ln for ln in proc.stdout.splitlines() if ln.startswith("HSFIX_CASE_RESULT ")), None
    )
    for f in sorted(status_dir.glob("*.json")):
        st = json.loads(f.read_text())
        result.statuses.append(
            {
                "pid": st["pid"],
                "role": st["role"],
                "patches": {k: v["status"] for k, v in st["patches"].items()},
                "verify": st.get("verify"),
            }
        )
    for f in sorted(observe_dir.glob("*.json")):
        result.block_sizes.append(json.loads(f.read_text()))
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr or proc.stdout)[-1500:]
        result.error = f"vLLM run failed (exit {proc.returncode}); see {out_dir}/run.log\n{tail}"
        return result
    result.run = json.loads(line.split(" ", 1)[1])
    result.files = [p for p in result.run["paths"] if p]
    saved = []
    for p in result.run["paths"]:
        if not p or not Path(p).exists():
            result.error = f"no hidden-states file for a request ({p})"
            return result
        saved.append(load_file(p))
    result.__dict__.update(compare(saved, reference(model, batch, case.aux_ids), batch))
    result.ok_run = True
    return result
