#!/usr/bin/env python3
"""What ``vllm-hsfix repair`` costs against vLLM doing the same work itself, in one run.

The same prompts (``BENCH_PROMPTS`` prompts of 16-400 tokens, default 96) are sent twice
on the installed vLLM, with the same connector and the same engine settings:

* baseline: vLLM's own ``LLM.generate(prompts, max_tokens=1)`` with
  ``extract_hidden_states`` + ``ExampleHiddenStatesConnector``, timed from after the
  engine is built until every file is written (its writer released the ``.lock``);
* repair: ``vllm-hsfix repair`` on a dataset of those prompts whose files are all wrong
  (zero rows, as 0.24.0 writes them), timed from its ``engine ready`` line to the line
  saying every file is regenerated and checked:
  regeneration, the row-by-row comparison with the old files, the atomic replacement
  and the journal; its re-audit and vLLM's shutdown come after and are timed apart.

``BENCH_REPEAT`` (default 3) alternating rounds, every engine with the same
``VLLM_CPU_KVCACHE_SPACE`` (2 GiB unless set). ``BENCH_TREES``: checkouts of
vllm-hsfix whose repair runs in each round, put first on ``PYTHONPATH`` (comma-separated,
default this one; e.g. ``.,/tmp/base`` for an A/B against a git worktree of another
commit). ``BENCH_MODEL``: ``hybrid`` (default, the tiny Qwen3.5) or ``dense`` (the tiny
Qwen3). Printed per round:
prompt tokens/s of each (repair: from its ``engine ready`` line to its ``regenerated
and checked`` line, i.e. with the comparison and the replacement) and the ratio repair /
baseline (goal >= 0.9); engine start and the time from the work's end to the process's
exit (vLLM's shutdown; for repair also the re-audit) apart, and the whole processes'
ratio; then the medians. Nothing is asserted; exit 2 when a run fails.

    python3 scripts/vllm_env.py exec 0.24.0 -- python benchmarks/bench_repair.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # hsfix_demo lives beside the package, not in it
AUX = [1, 2, 3]
MAX_MODEL_LEN = 512

BASELINE = textwrap.dedent(
    """
    import json, os, sys, time, fcntl
    from vllm import LLM, SamplingParams
    model, out, prompts = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3]))
    t0 = time.monotonic()
    llm = LLM(model=model, skip_tokenizer_init=True, enable_prefix_caching=False,
              enable_chunked_prefill=False, enforce_eager=True, max_model_len=%(mml)d,
              seed=0, **json.loads(sys.argv[4]),
              speculative_config={
                  "method": "extract_hidden_states", "num_speculative_tokens": 1,
                  "draft_model_config": {
                      "hf_config": {"eagle_aux_hidden_state_layer_ids": %(aux)s}}},
              kv_transfer_config={
                  "kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                  "kv_connector_extra_config": {"shared_storage_path": out}})
    ready = time.monotonic() - t0
    sp = SamplingParams(max_tokens=1, temperature=0.0)

    def written(p):
        if not os.path.exists(p):
            return False
        if not os.path.exists(p + ".lock"):
            return True
        with open(p + ".lock") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                return False

    t1 = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    paths = [o.kv_transfer_params["hidden_states_path"] for o in outs]
    while not all(written(p) for p in paths):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], sp, use_tqdm=False)
    print("BENCH " + json.dumps({"ready_s": ready, "work_s": time.monotonic() - t1}))
    """
) % {"mml": MAX_MODEL_LEN, "aux": AUX}


def prompts(n: int) -> list[list[int]]:
    import torch

    from hsfix_demo import tiny_model

    g = torch.Generator().manual_seed(6)
    lengths = [16 + (i * 383) // max(n - 1, 1) for i in range(n)]
    order = torch.randperm(n, generator=g).tolist()
    return [
        torch.randint(4, tiny_model.TEXT_VOCAB, (lengths[i],), generator=g).tolist() for i in order
    ]


def wrong_dataset(where: Path, batch: list[list[int]], hidden: int) -> None:
    """Files as a broken vLLM 0.24.0 leaves them: the right token ids, zero rows."""
    import torch
    from safetensors.torch import save_file

    where.mkdir(parents=True)
    for i, ids in enumerate(batch):
        save_file(
            {
                "hidden_states": torch.zeros(len(ids), len(AUX), hidden, dtype=torch.bfloat16),
                "token_ids": torch.tensor(ids, dtype=torch.int64),
            },
            str(where / f"hs_{i}.safetensors"),
        )


# The settings repair derives for each model (and says it does): the baseline's too.
SETTINGS = {
    "hybrid": {"dtype": "bfloat16", "mamba_ssm_cache_dtype": "float32",
               "language_model_only": True},
    "dense": {"dtype": "bfloat16"},
}  # fmt: skip


def main() -> int:
    from hsfix_demo import tiny_model

    n = int(os.environ.get("BENCH_PROMPTS", "96"))
    reps = int(os.environ.get("BENCH_REPEAT", "3"))
    kind = os.environ.get("BENCH_MODEL", "hybrid")
    trees = [str(Path(t).resolve()) for t in os.environ.get("BENCH_TREES", str(ROOT)).split(",")]
    cache = Path(os.environ.get("VLLM_HSFIX_CACHE", Path.home() / ".cache" / "vllm-hsfix"))
    model = tiny_model.build(cache / "models" / kind, kind)
    cfg = json.loads((model / "config.json").read_text())
    hidden = cfg.get("text_config", cfg)["hidden_size"]
    batch = prompts(n)
    tokens = sum(map(len, batch))
    # Both engines get the same KV cache (repair would size its own on vLLM's CPU build
    # when this is unset; a bench compares like with like).
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    print(
        f"machine: {os.cpu_count()} CPUs; {kind} model, {n} prompts, {tokens} prompt tokens, "
        f"aux {AUX}, VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']}; {reps} rounds "
        f"of the baseline and the repair of {trees}"
    )
    ratios: dict[str, list[float]] = {t: [] for t in trees}
    wholes: dict[str, list[float]] = {t: [] for t in trees}
    for r in range(reps):
        order = trees if r % 2 == 0 else trees[::-1]  # neither always runs first
        found = one_round(model, batch, hidden, env, SETTINGS[kind], order)
        if found is None:
            return 2
        base, reps_of = found
        b_tps = tokens / base["work"]
        print(
            f"round {r}: baseline LLM.generate(max_tokens=1): engine {base['ready']:.1f} s, "
            f"{base['work']:.2f} s for the prompts = {b_tps:.0f} prompt tokens/s, exit "
            f"{base['exit']:.1f} s after; whole process {base['whole']:.1f} s"
        )
        for tree, rep in reps_of.items():
            r_tps = tokens / rep["work"]
            ratios[tree].append(r_tps / b_tps)
            wholes[tree].append(base["whole"] / rep["whole"])
            print(
                f"round {r}: repair of {tree}: audit + engine {rep['ready']:.1f} s, "
                f"{rep['work']:.2f} s from engine ready to every file regenerated, compared "
                f"and replaced = {r_tps:.0f} prompt tokens/s, exit {rep['exit']:.1f} s after "
                f"(vLLM's shutdown, the re-audit); whole process {rep['whole']:.1f} s; "
                f"ratio to the baseline {ratios[tree][-1]:.3f}"
            )
            if r == reps - 1:
                print(f"repair's lines in the last round ({tree}):")
                print("\n".join(rep["lines"]))
    for tree in trees:
        print(
            f"{tree}: ratio repair / baseline (prompt tokens/s): median "
            f"{statistics.median(ratios[tree]):.3f} of {[round(x, 3) for x in ratios[tree]]} "
            f"(goal >= 0.9); whole process: median {statistics.median(wholes[tree]):.3f}"
        )
    return 0


def one_round(
    model: Path,
    batch: list[list[int]],
    hidden: int,
    env: dict[str, str],
    settings: dict[str, object],
    trees: list[str],
) -> tuple[dict, dict[str, dict]] | None:
    """The baseline, then each tree's repair, on the same prompts: their times (None: a
    run failed)."""
    with tempfile.TemporaryDirectory(prefix="bench-repair-") as d:
        work = Path(d)
        (work / "prompts.json").write_text(json.dumps(batch))
        t0 = time.monotonic()
        base_lines, bench_at, base_rc = timed(
            [sys.executable, "-c", BASELINE, str(model), str(work / "out"),
             str(work / "prompts.json"), json.dumps(settings)],
            env, "BENCH ",
        )  # fmt: skip
        base_end = time.monotonic()
        lines = [ln for _, ln in base_lines if ln.startswith("BENCH ")]
        if base_rc != 0 or not lines or bench_at is None:
            print(f"baseline failed ({base_rc}):")
            print("\n".join(ln for _, ln in base_lines[-40:]))
            return None
        b = json.loads(lines[-1][6:])
        reps = {}
        for i, tree in enumerate(trees):
            rep = one_repair(work / f"ds{i}", work / f"s{i}.jsonl", model, batch, hidden, env, tree)
            if rep is None:
                return None
            reps[tree] = rep
    base = {
        "ready": b["ready_s"], "work": b["work_s"], "exit": base_end - bench_at,
        "whole": base_end - t0,
    }  # fmt: skip
    return base, reps


def one_repair(
    ds: Path,
    state: Path,
    model: Path,
    batch: list[list[int]],
    hidden: int,
    env: dict[str, str],
    tree: str,
) -> dict | None:
    """``vllm-hsfix repair`` of ``tree`` on a wrong dataset of ``batch``: its times."""
    wrong_dataset(ds, batch, hidden)
    cmd = [
        sys.executable, "-m", "vllm_hsfix", "repair", str(ds), "--model", str(model),
        "--aux-layers", ",".join(map(str, AUX)), "--no-progress", "--state", str(state),
        "--engine-arg", f"max_model_len={MAX_MODEL_LEN}",
    ]  # fmt: skip
    # The tree first on PYTHONPATH, from a directory of no tree (``-m`` looks there first).
    path = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH", "")) if p)
    where = subprocess.run(
        [sys.executable, "-c", "import vllm_hsfix; print(vllm_hsfix.__file__)"],
        env={**env, "PYTHONPATH": path}, cwd=ds.parent, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    if not where.startswith(tree + os.sep):
        print(f"repair of {tree}: vllm_hsfix comes from {where!r} there")
        return None
    t1 = time.monotonic()
    rep_lines, _, rc = timed(cmd, {**env, "PYTHONPATH": path}, None, cwd=ds.parent)
    end = time.monotonic()
    ready_at = next((t for t, ln in rep_lines if "engine ready in" in ln), None)
    done_at = next((t for t, ln in rep_lines if "regenerated and checked" in ln), None)
    if rc != 0 or ready_at is None or done_at is None:
        print(f"repair of {tree} failed ({rc}):")
        print("\n".join(ln for _, ln in rep_lines[-40:]))
        return None
    shown = [
        f"  +{t - t1:6.1f} s  {ln.strip()[:110]}"
        for t, ln in rep_lines
        if ln.startswith(("repair:", "result:"))
    ]
    return {
        "ready": ready_at - t1, "work": done_at - ready_at, "exit": end - done_at,
        "whole": end - t1, "lines": shown,
    }  # fmt: skip


def timed(
    cmd: list[str], env: dict[str, str], mark: str | None, cwd: Path | None = None
) -> tuple[list[tuple[float, str]], float | None, int]:
    """Run ``cmd`` with stdout and stderr merged; every line with when it came, when the
    first line starting with ``mark`` came, and the exit status."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd
    )
    assert proc.stdout is not None
    out: list[tuple[float, str]] = []
    at = None
    for line in proc.stdout:
        now = time.monotonic()
        out.append((now, line.rstrip("\n")))
        if mark and at is None and line.startswith(mark):
            at = now
    return out, at, proc.wait()


if __name__ == "__main__":
    sys.exit(main())
