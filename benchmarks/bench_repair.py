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

``BENCH_REPEAT`` (default 3) alternating pairs, both engines with the same
``VLLM_CPU_KVCACHE_SPACE`` (2 GiB unless set). Printed per pair: prompt tokens/s of
each (repair: from its ``engine ready`` line to its ``regenerated and checked`` line,
i.e. with the comparison and the replacement) and the ratio repair / baseline (goal
>= 0.9); engine start and the time from the work's end to the process's exit (vLLM's
shutdown; for repair also the re-audit) are reported apart, and the whole processes'
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
              dtype="bfloat16", mamba_ssm_cache_dtype="float32", language_model_only=True,
              seed=0,
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


def main() -> int:
    from hsfix_demo import tiny_model

    n = int(os.environ.get("BENCH_PROMPTS", "96"))
    reps = int(os.environ.get("BENCH_REPEAT", "3"))
    cache = Path(os.environ.get("VLLM_HSFIX_CACHE", Path.home() / ".cache" / "vllm-hsfix"))
    model = tiny_model.build(cache / "models" / "hybrid", "hybrid")
    hidden = json.loads((model / "config.json").read_text())["text_config"]["hidden_size"]
    batch = prompts(n)
    tokens = sum(map(len, batch))
    # Both engines get the same KV cache (repair would size its own on vLLM's CPU build
    # when this is unset; a bench compares like with like).
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    print(
        f"machine: {os.cpu_count()} CPUs; {n} prompts, {tokens} prompt tokens, aux {AUX}, "
        f"VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']}; {reps} alternating pairs"
    )
    ratios, wholes = [], []
    for r in range(reps):
        pair = one_pair(model, batch, hidden, env)
        if pair is None:
            return 2
        base, rep = pair
        b_tps, r_tps = tokens / base["work"], tokens / rep["work"]
        ratios.append(r_tps / b_tps)
        wholes.append(base["whole"] / rep["whole"])
        print(
            f"pair {r}: baseline LLM.generate(max_tokens=1): engine {base['ready']:.1f} s, "
            f"{base['work']:.2f} s for the prompts = {b_tps:.0f} prompt tokens/s, exit "
            f"{base['exit']:.1f} s after; whole process {base['whole']:.1f} s"
        )
        print(
            f"pair {r}: vllm-hsfix repair: audit + engine {rep['ready']:.1f} s, "
            f"{rep['work']:.2f} s from engine ready to every file regenerated, compared "
            f"and replaced = {r_tps:.0f} prompt tokens/s, exit {rep['exit']:.1f} s after "
            f"(vLLM's shutdown, the re-audit); whole process {rep['whole']:.1f} s"
        )
        print(f"pair {r}: ratio repair / baseline (prompt tokens/s) {ratios[-1]:.3f}")
        if r == reps - 1:
            print("repair's lines in the last pair:")
            print("\n".join(rep["lines"]))
    print(
        f"ratio repair / baseline (prompt tokens/s): median {statistics.median(ratios):.3f} "
        f"of {[round(x, 3) for x in ratios]} (goal >= 0.9)"
    )
    print(f"ratio repair / baseline (whole process): median {statistics.median(wholes):.3f}")
    return 0


def one_pair(
    model: Path, batch: list[list[int]], hidden: int, env: dict[str, str]
) -> tuple[dict, dict] | None:
    """The baseline, then repair, on the same prompts: their times (None: a run failed)."""
    with tempfile.TemporaryDirectory(prefix="bench-repair-") as d:
        work = Path(d)
        (work / "prompts.json").write_text(json.dumps(batch))
        t0 = time.monotonic()
        base_lines, bench_at, base_rc = timed(
            [sys.executable, "-c", BASELINE, str(model), str(work / "out"),
             str(work / "prompts.json")],
            env, "BENCH ",
        )  # fmt: skip
        base_end = time.monotonic()
        lines = [ln for _, ln in base_lines if ln.startswith("BENCH ")]
        if base_rc != 0 or not lines or bench_at is None:
            print(f"baseline failed ({base_rc}):")
            print("\n".join(ln for _, ln in base_lines[-40:]))
            return None
        b = json.loads(lines[-1][6:])
        wrong_dataset(work / "ds", batch, hidden)
        cmd = [
            sys.executable, "-m", "vllm_hsfix", "repair", str(work / "ds"), "--model", str(model),
            "--aux-layers", ",".join(map(str, AUX)), "--no-progress",
            "--state", str(work / "s.jsonl"),
            "--engine-arg", f"max_model_len={MAX_MODEL_LEN}",
        ]  # fmt: skip
        t1 = time.monotonic()
        rep_lines, _, rc = timed(cmd, env, None)
        end = time.monotonic()
        ready_at = next((t for t, ln in rep_lines if "engine ready in" in ln), None)
        done_at = next((t for t, ln in rep_lines if "regenerated and checked" in ln), None)
        if rc != 0 or ready_at is None or done_at is None:
            print(f"repair failed ({rc}):")
            print("\n".join(ln for _, ln in rep_lines[-40:]))
            return None
    base = {
        "ready": b["ready_s"], "work": b["work_s"], "exit": base_end - bench_at,
        "whole": base_end - t0,
    }  # fmt: skip
    shown = [
        f"  +{t - t1:6.1f} s  {ln.strip()[:110]}"
        for t, ln in rep_lines
        if ln.startswith(("repair:", "result:"))
    ]
    rep = {
        "ready": ready_at - t1, "work": done_at - ready_at, "exit": end - done_at,
        "whole": end - t1, "lines": shown,
    }  # fmt: skip
    return base, rep


def timed(
    cmd: list[str], env: dict[str, str], mark: str | None
) -> tuple[list[tuple[float, str]], float | None, int]:
    """Run ``cmd`` with stdout and stderr merged; every line with when it came, when the
    first line starting with ``mark`` came, and the exit status."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
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
