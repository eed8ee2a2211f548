"""``vllm-hsfix repair PATHS --model MODEL_DIR``: regenerate exactly the bad files.

Flow: targets (an audit here, or ``--from-audit``) -> what each file must keep (its
token ids, tensor names, dtype, ``[n_aux, hidden]``) -> the engine settings the
extraction ran with (:mod:`.settings`) -> the guard before vLLM starts -> one vLLM
engine per file format (its own process), the guard again inside it before the first
request -> per regenerated file: checked, compared with the old one row by row (all
rows agree: the old file was right after all and stays byte for byte, :mod:`.compare`),
else put in place atomically; journaled -> the dataset audited again -> counts. A
failed vLLM run is reported by its root cause and its kept log (:mod:`..enginelog`).

Exit codes: 0 every targeted file is now ``ok`` (or there was nothing to repair); 1 a
targeted file is still bad or was skipped, the vLLM run failed, or the fix is not
active where vLLM runs (then nothing is written); 2 usage (no such path, no model, no
aux layers known, a bad ``--shard`` or ``--engine-arg``, an engine argument vLLM has no
such name for or rejects, ...). ``--dry-run`` lists what would be regenerated and
exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from .. import detect, enginelog
from ..audit.pipeline import audit_paths
from ..audit.progress import SILENT, Factory, for_stream
from ..audit.reports import CORRUPT, OK, SUSPECT
from . import compare, guard, settings
from ._run import BADARG, DONE, FILE, GUARD
from .journal import Journal
from .taking import Counts, Taker
from .targets import Target, from_audit_output, read_target, shard
from .watch import ChildTree

DEFAULT_STATE = ".vllm-hsfix-repair.jsonl"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "repair",
        help="regenerate the files an audit found corrupt, with the fixed vLLM",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("paths", nargs="+", help="the dataset: files or directories")
    p.add_argument("--model", help="the verifier the dataset was made with (a local dir)")
    p.add_argument(
        "--aux-layers",
        default=None,
        help="eagle_aux_hidden_state_layer_ids, e.g. 1,2,3 (else from the files' "
        "provenance metadata)",
    )
    p.add_argument("--from-audit", metavar="FILE", help="an audit's --jsonl or --list output")
    p.add_argument("--include-suspect", action="store_true", help="regenerate suspect files too")
    p.add_argument("--backup", metavar="DIR", help="keep each old file here before replacing it")
    p.add_argument(
        "--state",
        metavar="FILE",
        default=DEFAULT_STATE,
        help=f"journal of replaced files, for resuming (default ./{DEFAULT_STATE})",
    )
    p.add_argument("--dry-run", action="store_true", help="list what would be regenerated")
    p.add_argument("--batch-size", type=int, default=256, help="prompts per engine batch")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more vllm.LLM keyword arguments, e.g. dtype=bfloat16 or enforce_eager=true "
        "(VALUE is JSON when it parses, else a string; repeatable; overrides the settings "
        "read from the files' provenance or derived from the checkpoint)",
    )
    p.add_argument("--endpoint", metavar="URL", help="use this running vllm serve instead")
    p.add_argument("--shard", metavar="K/N", help="only every N-th target from the K-th")
    p.add_argument("--workers", type=int, default=None, help="audit worker processes")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(fn=run)
    return p


def _usage(args: argparse.Namespace) -> str | None:
    for path in args.paths:
        if not os.path.exists(path):
            return f"no such file or directory: {path}"
    if args.batch_size < 1:
        return f"--batch-size must be >= 1, got {args.batch_size}"
    needs_model = not args.dry_run and not args.endpoint
    if needs_model and not (args.model and os.path.isfile(os.path.join(args.model, "config.json"))):
        return f"--model {args.model}: no config.json there (missing model)"
    try:
        shard([], args.shard)
        settings.parse_engine_args(args.engine_arg)
    except ValueError as exc:
        return str(exc)
    return None


def _aux(args: argparse.Namespace, targets: list[Target]) -> tuple[int, ...] | str:
    if args.aux_layers:
        try:
            return tuple(int(a) for a in args.aux_layers.split(",") if a.strip())
        except ValueError:
            return f"--aux-layers {args.aux_layers}: expected integers, e.g. 1,2,3"
    stamped = {t.aux_layers for t in targets if t.aux_layers}
    if len(stamped) == 1:
        return stamped.pop()  # type: ignore[return-value]
    if len(stamped) > 1:
        return (
            f"the files' provenance names different aux layers {sorted(stamped)}: pass --aux-layers"
        )
    return (
        "the aux layers are not known: pass --aux-layers (the files carry no "
        "vllm_hsfix.aux_layers provenance metadata)"
    )


def _start_engine(
    job: dict[str, Any], workdir: str, log_path: str, extra_env: dict[str, str]
) -> subprocess.Popen[str]:
    path = os.path.join(workdir, "job.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(job, f)
    env = dict(os.environ, VLLM_HSFIX_STATUS_DIR=job["status_dir"], **extra_env)
    # Regenerated files say what made them (vllm-hsfix, vLLM, patches, aux layers):
    # the proof a training pipeline can check. VLLM_HSFIX_PROVENANCE=0 turns it off.
    env.setdefault("VLLM_HSFIX_PROVENANCE", "1")
    log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115
    try:
        return subprocess.Popen(
            [sys.executable, "-u", "-m", "vllm_hsfix.repair._run", path],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
        )
    finally:
        log.close()


def failure(code: int, log: str) -> str:
    """Why the vLLM process ended with ``code``. A signal that killed it is the root
    cause: what its engine core logged as it went down after it (``RuntimeError:
    cancelled``) is not, so the log is only pointed at."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return (
            f"the vLLM run failed: its process was killed by {name} (the OOM killer, a "
            f"user; `dmesg` names OOM kills); full log: {log}"
        )
    return f"the vLLM run failed (exit {code}); {enginelog.explain(log)}"


def log_path(state: str) -> str:
    """Where vLLM's log of a repair goes: next to the journal (kept if the run fails)."""
    return os.path.abspath(os.path.splitext(state)[0] + ".vllm.log")


def run(args: argparse.Namespace) -> int:
    err = sys.stderr
    problem = _usage(args)
    if problem:
        print(f"vllm-hsfix repair: {problem}", file=err)
        return 2
    progress: Factory = SILENT if args.no_progress else for_stream(err, second="tokens", prefix="")
    audit_state = args.state + ".audit"
    if args.from_audit:
        paths = from_audit_output(args.from_audit, args.include_suspect)
    else:
        audit_progress = SILENT if args.no_progress else for_stream(err)
        report = audit_paths(
            args.paths, args.workers, audit_progress, state=audit_state, keep=False
        )
        wanted = {CORRUPT, SUSPECT} if args.include_suspect else {CORRUPT}
        paths = [p for p, v in report.verdicts if v in wanted]
    paths = shard(paths, args.shard)
    journal = Journal(args.state)
    done_before = [p for p in paths if journal.is_done(p)]
    counts = Counts()
    targets: list[Target] = []
    for p in paths:
        if p in done_before:
            continue
        t = read_target(p)
        if t.problem:
            counts.skip(p, t.problem)
        else:
            targets.append(t)
    aux = _aux(args, targets) if targets else ()
    if isinstance(aux, str):
        print(f"vllm-hsfix repair: {aux}", file=err)
        return 2
    for p in done_before:
        if journal.done[p].get("status") == "right":
            counts.right[p] = None  # an earlier run found it right and kept it
        else:
            counts.earlier.add(p)
    longest = max((t.tokens for t in targets), default=0)
    max_len = args.max_model_len or max(16, longest + 2)
    engine_args: dict[str, Any] = settings.parse_engine_args(args.engine_arg)
    said = None
    if targets and not args.endpoint:
        engine_args, max_len, said = settings.engine_settings(
            args.model,
            targets,
            bool(detect.detect().cpu_build),
            engine_args,
            max_len,
            args.max_model_len,
        )
    for t in list(targets):
        why = None
        if t.n_aux is not None and t.n_aux != len(aux):
            why = f"the file has {t.n_aux} aux layers, --aux-layers gives {len(aux)}"
        elif t.tokens + 1 > max_len:
            why = f"{t.tokens} tokens do not fit --max-model-len {max_len}"
        if why:
            counts.skip(t.path, why)
            targets.remove(t)
    n_tokens = sum(t.tokens for t in targets)
    print(
        f"repair: {len(paths)} targeted files, {len(targets)} to regenerate ({n_tokens} "
        f"tokens), {len(counts.skipped)} skipped, {len(done_before)} already repaired by an "
        f"earlier run (the journal holds {journal.count('replaced')} replaced files"
        + (f" and {journal.count('right')} right after all" if journal.count("right") else "")
        + ")",
        file=err,
    )
    if said:
        print(f"repair: {said}", file=err)
    if args.dry_run:
        for t in targets:
            print(f"{t.path}\t{t.tokens} tokens")
        for p, why in counts.skipped.items():
            print(f"# skip {p}: {why}")
        print(f"would regenerate {len(targets)} files, {n_tokens} tokens")
        return 0
    if targets:
        for fp8 in sorted({t.fp8 for t in targets}):  # one engine per file format
            group = [t for t in targets if t.fp8 == fp8]
            engine = {"aux": tuple(aux), "max_len": max_len, "args": engine_args, "fp8": fp8}
            status = _regenerate(args, group, engine, journal, counts, progress)
            if status is not None:
                return status
    journal.close()
    return _finish(args, paths, counts, audit_state)


def _regenerate(
    args: argparse.Namespace,
    targets: list[Target],
    engine: dict[str, Any],
    journal: Journal,
    counts: Counts,
    progress: Factory,
) -> int | None:
    """Run the engine over ``targets``; None to go on, else the exit code."""
    err = sys.stderr
    problems, needed = guard.preflight()
    if problems and not args.endpoint:
        print("vllm-hsfix repair: the fix is not active here; nothing written:", file=err)
        for p in problems:
            print(f"  {p}", file=err)
        return 1
    if engine["fp8"] and not args.endpoint and importlib.util.find_spec("hs_connectors") is None:
        print(
            f"vllm-hsfix repair: {len(targets)} files are hs-connectors' fp8 files; they are "
            "regenerated by its own FP8HiddenStatesConnector: install hs-connectors here",
            file=err,
        )
        return 2
    root = args.paths[0] if len(args.paths) == 1 and os.path.isdir(args.paths[0]) else None
    extra_env = {}
    sized = settings.KV_ENV in os.environ or settings.KV_ARGS & set(engine["args"])
    if not args.endpoint and not sized and detect.detect().cpu_build:
        gib, line = settings.kv_cache_space(
            args.model,
            engine["args"].get("dtype"),
            len(engine["aux"]),
            min(args.batch_size, len(targets)),
            engine["max_len"],
        )
        extra_env[settings.KV_ENV] = str(gib)
        print(f"repair: {line}", file=err)
    log = log_path(args.state)
    with tempfile.TemporaryDirectory(prefix="vllm-hsfix-repair-") as work:
        job = {
            "spec": {
                "model": args.model,
                "aux_layers": list(engine["aux"]),
                "max_model_len": engine["max_len"],
                "tensor_parallel_size": args.tensor_parallel_size,
                "data_parallel_size": args.data_parallel_size,
                "engine_args": engine["args"],
                "fp8": engine["fp8"],
            },
            "user_args": settings.parse_engine_args(args.engine_arg),
            "endpoint": args.endpoint,
            "served": args.model if args.endpoint and args.model else None,
            "scratch": os.path.join(work, "hs"),
            "status_dir": os.path.join(work, "status"),
            "needed": needed,
            "prompts": [t.token_ids for t in targets],
            "batch_size": args.batch_size,
        }
        t0 = time.monotonic()
        proc = _start_engine(job, work, log, extra_env)
        tree = ChildTree(proc)  # what a killed vLLM process leaves must not keep us waiting
        taker = Taker(args, root, journal, counts)
        bar = None
        ready = t0
        bad_args: list[tuple[str, str]] = []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(BADARG):
                    key, why = json.loads(line[len(BADARG) :])
                    bad_args.append((key, why))
                elif line.startswith(GUARD):
                    found = json.loads(line[len(GUARD) :])
                    if found:
                        print(
                            "vllm-hsfix repair: the fix is not active where vLLM runs; "
                            "nothing written:",
                            file=err,
                        )
                        for p in found:
                            print(f"  {p}", file=err)
                        print(f"vLLM's log: {log}", file=err)
                        return 1
                    print(f"repair: engine ready in {time.monotonic() - t0:.0f} s", file=err)
                    ready = time.monotonic()
                    bar = progress("repair", len(targets), sum(t.tokens for t in targets))
                elif line.startswith(FILE):
                    index, produced = json.loads(line[len(FILE) :])
                    taker.take(targets[index], produced)
                    for t in taker.drain():
                        if bar:
                            bar.update(1, t.tokens)
                elif line.startswith(DONE) and bar:
                    # The regeneration's own time, apart from vLLM's shutdown that follows
                    # (about 5 s on vLLM's CPU build, whatever the dataset's size).
                    for t in taker.drain(wait=True):
                        bar.update(1, t.tokens)
                    bar.close()
                    bar = None
                    took = time.monotonic() - ready
                    tokens = sum(t.tokens for t in targets)
                    print(
                        f"repair: {len(targets)} files regenerated and checked in {took:.1f} s "
                        f"({tokens / max(took, 1e-9):.0f} prompt tokens/s); stopping vLLM",
                        file=err,
                    )
            tree.eof.set()
            code = proc.wait()
        finally:
            taker.drain(wait=True)  # every file put in place is in the journal
            taker.close()
            if bar:
                bar.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            tree.kill()  # no vLLM process outlives the run
        if bad_args:
            user = dict(a.split("=", 1) for a in args.engine_arg if "=" in a)
            for key, why in bad_args:
                shown = f"{key}={user[key]}" if key in user else key
                print(f"vllm-hsfix repair: --engine-arg {shown}: {why}", file=err)
            print(enginelog.explain(log).splitlines()[-1], file=err)
            return 2
        if code != 0:
            print(f"vllm-hsfix repair: {failure(code, log)}", file=err)
            return 1
    with contextlib.suppress(OSError):
        os.unlink(log)  # kept only when the run failed
    return None


def _finish(args: argparse.Namespace, paths: list[str], counts: Counts, audit_state: str) -> int:
    """Audit again (the replaced files with their prefix neighbours: the whole input,
    unchanged files from the audit state) and say how every targeted file ended. A
    file found right after all counts as ok whatever the audit says of it now; so does
    a regenerated file the audit only calls suspect (a statistical flag, e.g. a norm
    outlier, on what the fixed engine wrote: nothing left to repair), named with why."""
    err = sys.stderr
    audit_progress = SILENT if args.no_progress else for_stream(err)
    targeted = set(paths)
    why_suspect: dict[str, str] = {}

    def note(record: dict[str, Any]) -> None:
        path = record.get("path")
        if path in targeted and record.get("verdict") == SUSPECT:
            found = [p for p in record.get("problems", []) if p.get("severity") == SUSPECT]
            if found:
                why_suspect[path] = f"{found[0]['code']}: {found[0]['detail']}"

    report = audit_paths(
        paths if args.from_audit else args.paths,
        args.workers,
        audit_progress,
        state=audit_state,
        keep=False,
        on_record=note,
    )
    verdict = dict(report.verdicts)
    regenerated = set(counts.replaced) | counts.earlier
    suspect_now = sorted(p for p in regenerated if verdict.get(p) == SUSPECT)
    now_ok = sorted(
        p for p in targeted if verdict.get(p) == OK or p in counts.right or p in suspect_now
    )
    still_bad = sorted(p for p in targeted if p not in now_ok and p not in counts.skipped)
    print(
        f"repair: {len(counts.replaced)} regenerated this run, {len(counts.right)} right "
        f"after all (kept as they were); of {len(targeted)} targeted files {len(now_ok)} "
        f"are ok now, {len(still_bad)} still bad, {len(counts.skipped)} skipped",
    )
    for p, dist in sorted(counts.right.items()):
        how = "" if dist is None else f" (largest row difference {dist:.3f} < {compare.TOLERANCE})"
        flag = "" if verdict.get(p) == OK else f"; the audit still says {verdict.get(p)}"
        print(
            f"  right after all {p}: the regenerated file agrees with it row by row{how}: "
            f"the audit's finding was a false alarm, the file is unchanged{flag}"
        )
    for p in suspect_now:
        why = why_suspect.get(p, "see vllm-hsfix audit --show all")
        print(
            f"  regenerated, the audit calls it suspect {p}: {why} (what the fixed engine "
            "wrote; nothing left to repair, worth a look)"
        )
    for p in still_bad:
        why = counts.refused.get(p) or f"audit says {verdict.get(p)} after regeneration"
        print(f"  still bad {p}: {why}")
    for p, why in sorted(counts.skipped.items()):
        print(f"  skipped {p}: {why}")
    ok = not still_bad and not counts.skipped
    text = "every targeted file is ok" if ok else "NOT every targeted file is ok"
    if ok and suspect_now:
        text += f" ({len(suspect_now)} regenerated files the audit calls suspect, listed above)"
    print("result: " + text)
    return 0 if ok else 1
