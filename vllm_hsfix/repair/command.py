"""``vllm-hsfix repair PATHS --model MODEL_DIR``: regenerate exactly the bad files.

The targets (an audit, or ``--from-audit``) and what each must keep (:mod:`.files`), the
engine settings (:mod:`.settings`), the guard (:mod:`.guard`), one vLLM process per file
format (:mod:`.engine`); each regenerated file checked, kept when the old one was right
after all, else put in place and journaled (:mod:`.journal`); a re-audit; the verdicts.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .. import detect, enginelog
from . import files, guard, settings, watch
from .engine import llm_kwargs
from .files import CORRUPT, OK, SUSPECT, Target
from .journal import Journal, sha256

DEFAULT_STATE = ".vllm-hsfix-repair.jsonl"
THREADS = 4
EPILOG = """\
exit codes: 0 every targeted file is ok now (or nothing needed repair; --dry-run);
1 a targeted file is still bad or was skipped, the vLLM run failed, or the fix is not
active where vLLM runs (then nothing is written); 2 usage (no such path, no model, no
aux layers known, a bad --shard or --engine-arg, an engine argument vLLM rejects).

several machines: run `repair --shard K/N` on each (K = 0..N-1, the same PATHS or
--from-audit file): each takes every N-th target of the sorted list from the K-th, so
the machines split the work without talking to each other; give each its own --state
(the journal, and the audit state beside it). A verifier larger than one machine:
vLLM's own Ray backend, e.g. --tensor-parallel-size 16 --engine-arg
distributed_executor_backend=ray on a node of a running Ray cluster (RAY_ADDRESS).
"""


OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("--model", {"help": "the verifier the dataset was made with (a local dir)"}),
    ("--aux-layers", {"help": "eagle_aux_hidden_state_layer_ids, e.g. 1,2,3 (else from the "
                      "files' provenance metadata)"}),
    ("--from-audit", {"metavar": "FILE", "help": "an audit's --jsonl or --list output"}),
    ("--include-suspect", {"action": "store_true", "help": "regenerate suspect files too"}),
    ("--backup", {"metavar": "DIR", "help": "keep each old file here before replacing it"}),
    ("--state", {"metavar": "FILE", "default": DEFAULT_STATE,
                 "help": f"journal of replaced files, for resuming (default ./{DEFAULT_STATE})"}),
    ("--dry-run", {"action": "store_true", "help": "list what would be regenerated"}),
    ("--batch-size", {"type": int, "default": 256, "help": "prompts per engine batch"}),
    ("--max-model-len", {"type": int}),
    ("--tensor-parallel-size", {"type": int, "default": 1}),
    ("--data-parallel-size", {"type": int, "default": 1}),
    ("--engine-arg", {"action": "append", "default": [], "metavar": "KEY=VALUE",
                      "help": "more vllm.LLM keyword arguments, e.g. dtype=bfloat16 or "
                      "enforce_eager=true (VALUE is JSON when it parses, else a string; "
                      "repeatable; overrides the settings read from the files' provenance "
                      "or derived from the checkpoint)"}),
    ("--endpoint", {"metavar": "URL", "help": "use this running vllm serve instead"}),
    ("--shard", {"metavar": "K/N", "help": "only every N-th target from the K-th"}),
    ("--workers", {"type": int, "help": "audit worker processes"}),
    ("--no-progress", {"action": "store_true"}),
]  # fmt: skip


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "repair",
        help="regenerate the files an audit found corrupt, with the fixed vLLM",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="+", help="the dataset: files or directories")
    for flag, kwargs in OPTIONS:
        p.add_argument(flag, **kwargs)
    p.set_defaults(fn=run)
    return p


@dataclass
class Counts:
    replaced: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # path -> why
    refused: dict[str, str] = field(default_factory=dict)  # path -> why not installed
    right: dict[str, float | None] = field(default_factory=dict)  # kept: right after all
    earlier: set[str] = field(default_factory=set)  # replaced by an earlier run


def _stop(problem: str, code: int, details: list[str] = ()) -> int:  # type: ignore[assignment]
    print(f"vllm-hsfix repair: {problem}", file=sys.stderr)
    for line in details:
        print(f"  {line}", file=sys.stderr)
    return code


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
        files.shard([], args.shard)
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


def run(args: argparse.Namespace) -> int:
    problem = _usage(args)
    if problem:
        return _stop(problem, 2)
    audit_state = args.state + ".audit"
    if args.from_audit:
        paths = files.from_audit_output(args.from_audit, args.include_suspect)
    else:
        wanted = {CORRUPT, SUSPECT} if args.include_suspect else {CORRUPT}
        verdicts = files.audit(args.paths, args, audit_state)
        paths = [p for p, v in verdicts.items() if v in wanted]
    paths = files.shard(paths, args.shard)
    journal = Journal(args.state)
    counts = Counts()
    targets = _targets(paths, journal, counts)
    aux = _aux(args, targets) if targets else ()
    if isinstance(aux, str):
        return _stop(aux, 2)
    engine, said = _engine(args, targets, aux, counts)
    _plan(paths, targets, counts, journal, said)
    if args.dry_run:
        for t in targets:
            print(f"{t.path}\t{t.tokens} tokens")
        for p, why in counts.skipped.items():
            print(f"# skip {p}: {why}")
        print(f"would regenerate {len(targets)} files, {sum(t.tokens for t in targets)} tokens")
        return 0
    for fp8 in sorted({t.fp8 for t in targets}):  # one engine per file format
        group = [t for t in targets if t.fp8 == fp8]
        status = _regenerate(args, group, {**engine, "fp8": fp8}, journal, counts)
        if status is not None:
            return status
    return finish(args, paths, counts, audit_state)


def _targets(paths: list[str], journal: Journal, counts: Counts) -> list[Target]:
    """The targets to regenerate; those an earlier run finished go to ``counts``."""
    out = []
    for p in paths:
        if journal.is_done(p):
            if journal.done[p].get("status") == "right":
                counts.right[p] = None  # an earlier run found it right and kept it
            else:
                counts.earlier.add(p)
        elif (t := files.read_target(p)).problem:
            counts.skipped[p] = t.problem
        else:
            out.append(t)
    return out


def _engine(
    args: argparse.Namespace, targets: list[Target], aux: tuple[int, ...], counts: Counts
) -> tuple[dict[str, Any], str | None]:
    """The engine's settings; a target that cannot run under them is skipped."""
    max_len = args.max_model_len or max(16, max((t.tokens for t in targets), default=0) + 2)
    engine_args: dict[str, Any] = settings.parse_engine_args(args.engine_arg)
    said = None
    if targets and not args.endpoint:
        cpu_build = bool(detect.detect().cpu_build)
        engine_args, max_len, said = settings.engine_settings(
            args.model, targets, cpu_build, engine_args, max_len, args.max_model_len
        )
    for t in list(targets):
        why = None
        if t.n_aux is not None and t.n_aux != len(aux):
            why = f"the file has {t.n_aux} aux layers, --aux-layers gives {len(aux)}"
        elif t.tokens + 1 > max_len:
            why = f"{t.tokens} tokens do not fit --max-model-len {max_len}"
        if why:
            counts.skipped[t.path] = why
            targets.remove(t)
    return {"aux": list(aux), "max_len": max_len, "engine_args": engine_args}, said


def _plan(
    paths: list[str], targets: list[Target], counts: Counts, journal: Journal, said: str | None
) -> None:
    right = journal.count("right")
    print(
        f"repair: {len(paths)} targeted files, {len(targets)} to regenerate "
        f"({sum(t.tokens for t in targets)} tokens), {len(counts.skipped)} skipped, "
        f"{len(counts.earlier) + len(counts.right)} already repaired by an earlier run "
        f"(the journal holds {journal.count('replaced')} replaced files"
        + (f" and {right} right after all" if right else "")
        + ")",
        file=sys.stderr,
    )
    if said:
        print(f"repair: {said}", file=sys.stderr)


def failure(code: int, log: str) -> str:
    """Why the vLLM process ended with ``code``. A signal that killed it is the root
    cause, not what its engine core logged as it went down after it."""
    if code >= 0:
        return f"the vLLM run failed (exit {code}); {enginelog.explain(log)}"
    return (
        f"the vLLM run failed: its process was killed by {watch.signal_name(-code)} (the "
        f"OOM killer, a user; `dmesg` names OOM kills); full log: {log}"
    )


def log_path(state: str) -> str:
    """Where vLLM's log of a repair goes: next to the journal (kept if the run fails)."""
    return os.path.abspath(os.path.splitext(state)[0] + ".vllm.log")


def _regenerate(
    args: argparse.Namespace,
    targets: list[Target],
    engine: dict[str, Any],
    journal: Journal,
    counts: Counts,
) -> int | None:
    """Run the engine over ``targets``; None to go on, else the exit code."""
    problems, needed = guard.preflight()
    if problems and not args.endpoint:
        return _stop("the fix is not active here; nothing written:", 1, problems)
    if engine["fp8"] and not args.endpoint and importlib.util.find_spec("hs_connectors") is None:
        return _stop(
            f"{len(targets)} files are hs-connectors' fp8 files; they are regenerated by "
            "its own FP8HiddenStatesConnector: install hs-connectors here",
            2,
        )
    log = log_path(args.state)
    with tempfile.TemporaryDirectory(prefix="vllm-hsfix-repair-") as work:
        proc = _start(args, targets, engine, needed, work, log)
        follow = Follow(args, targets, journal, counts)
        code = follow.run(proc)
    if follow.refused:
        refused = [*follow.refused, f"vLLM's log: {log}"]
        return _stop("the fix is not active where vLLM runs; nothing written:", 1, refused)
    if follow.bad_args:
        user = dict(a.split("=", 1) for a in args.engine_arg if "=" in a)
        for key, why in follow.bad_args:
            shown = f"{key}={user[key]}" if key in user else key
            _stop(f"--engine-arg {shown}: {why}", 2)
        print(enginelog.explain(log).splitlines()[-1], file=sys.stderr)
        return 2
    if code != 0:
        return _stop(failure(code, log), 1)
    with contextlib.suppress(OSError):
        os.unlink(log)  # kept only when the run failed
    return None


def _start(
    args: argparse.Namespace,
    targets: list[Target],
    engine: dict[str, Any],
    needed: list[str],
    work: str,
    log: str,
) -> subprocess.Popen[str]:
    """The repair's vLLM process (:mod:`.engine`), its stderr the log."""
    env = dict(os.environ, VLLM_HSFIX_STATUS_DIR=os.path.join(work, "status"))
    env.setdefault("VLLM_HSFIX_PROVENANCE", "1")  # regenerated files say what made them
    sized = settings.KV_ENV in os.environ or settings.KV_ARGS & set(engine["engine_args"])
    if not args.endpoint and not sized and detect.detect().cpu_build:
        gib, line = settings.kv_cache_space(
            args.model,
            engine["engine_args"].get("dtype"),
            len(engine["aux"]),
            min(args.batch_size, len(targets)),
            engine["max_len"],
        )
        env[settings.KV_ENV] = str(gib)
        print(f"repair: {line}", file=sys.stderr)
    spec = {**engine, "model": args.model, "tensor_parallel_size": args.tensor_parallel_size}
    spec["data_parallel_size"] = args.data_parallel_size
    job = {
        "kwargs": llm_kwargs(spec, os.path.join(work, "hs")),
        "user_args": settings.parse_engine_args(args.engine_arg),
        "endpoint": args.endpoint,
        "served": args.model if args.endpoint else None,
        "status_dir": env["VLLM_HSFIX_STATUS_DIR"],
        "needed": needed,
        "prompts": [t.token_ids for t in targets],
        "batch_size": args.batch_size,
    }
    path = os.path.join(work, "job.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(job, f)
    with open(log, "w", encoding="utf-8") as err:
        return subprocess.Popen(
            [sys.executable, "-u", "-m", "vllm_hsfix.repair.engine", path],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )


class Follow:
    """Reads the vLLM process's messages (:mod:`.engine`'s JSON lines) and acts on them."""

    def __init__(
        self, args: argparse.Namespace, targets: list[Target], journal: Journal, counts: Counts
    ) -> None:
        self.args, self.targets, self.journal, self.counts = args, targets, journal, counts
        self.root = args.paths[0] if len(args.paths) == 1 and os.path.isdir(args.paths[0]) else None
        # A batch's files are taken on a few threads (reads, numpy, fsync release the GIL).
        self.pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="hsfix-take")
        self.pending: list[tuple[Target, Future[Any]]] = []
        self.progress = files.bar(args.no_progress)
        self.bar: Any = None
        self.t0 = self.ready = time.monotonic()
        self.bad_args: list[tuple[str, str]] = []
        self.refused: list[str] = []

    def run(self, proc: subprocess.Popen[str]) -> int:
        """Until the process ends (its exit status) or the guard refuses (-1)."""
        tree = watch.ChildTree(proc)  # what a killed vLLM process leaves must not block us
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if not self.on(message(line)):
                    return -1
            tree.eof.set()
            return proc.wait()
        finally:
            self.drain(wait=True)  # every file in place is journaled
            self.pool.shutdown()
            if self.bar:
                self.bar.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            tree.kill()  # no vLLM process outlives the run

    def on(self, msg: dict[str, Any]) -> bool:
        """Act on one message; False: stop reading (the guard refused)."""
        event = msg.get("event")
        if event == "bad_arg":
            self.bad_args.append((msg["key"], msg["why"]))
        elif event == "guard" and msg["problems"]:
            self.refused = msg["problems"]
            return False
        elif event == "guard":
            print(f"repair: engine ready in {time.monotonic() - self.t0:.0f} s", file=sys.stderr)
            self.ready = time.monotonic()
            tokens = sum(t.tokens for t in self.targets)
            self.bar = self.progress("repair", len(self.targets), tokens)
        elif event == "file":
            t = self.targets[msg["index"]]
            args = (self.args, t, msg["path"], self.root)
            self.pending.append((t, self.pool.submit(files.outcome, *args)))
            self.drain()
        elif event == "done" and self.bar:
            self.drain(wait=True)
            self.bar.close()
            self.bar = None
            # The regeneration's own time, apart from vLLM's shutdown that follows.
            took = max(time.monotonic() - self.ready, 1e-9)
            print(
                f"repair: {len(self.targets)} files regenerated and checked in {took:.1f} s "
                f"({sum(t.tokens for t in self.targets) / took:.0f} prompt tokens/s); "
                "stopping vLLM",
                file=sys.stderr,
            )
        return True

    def drain(self, wait: bool = False) -> None:
        """Record the files taken whose outcome is known (all, with ``wait``), in order,
        on this thread, which alone writes the journal and the counts."""
        while self.pending and (wait or self.pending[0][1].done()):
            t, fut = self.pending.pop(0)
            kind, detail = fut.result()
            if kind == "refused":
                self.counts.refused[t.path] = detail
            elif kind == "right":
                self.counts.right[t.path] = detail
                self.journal.add(t.path, "right", sha256(t.path), os.path.getsize(t.path))
            else:
                self.journal.add(t.path, "replaced", *detail)
                self.counts.replaced.append(t.path)
            if self.bar:
                self.bar.update(1, t.tokens)


def message(line: str) -> dict[str, Any]:
    """One message of the vLLM process; {} for a line cut short by a kill."""
    try:
        msg = json.loads(line)
    except ValueError:
        return {}
    return msg if isinstance(msg, dict) else {}


def finish(args: argparse.Namespace, paths: list[str], counts: Counts, audit_state: str) -> int:
    """Audit again (the whole input: unchanged files come from the audit state) and say
    how every targeted file ended. A file right after all counts as ok whatever the
    audit says of it now; so does a regenerated file the audit only calls suspect (a
    statistical flag on what the fixed engine wrote), named with why."""
    targeted = set(paths)
    why_suspect: dict[str, str] = {}

    def note(record: dict[str, Any]) -> None:
        if record.get("path") in targeted and record.get("verdict") == SUSPECT:
            found = [p for p in record.get("problems", []) if p.get("severity") == SUSPECT]
            if found:
                why_suspect[record["path"]] = f"{found[0]['code']}: {found[0]['detail']}"

    verdict = files.audit(paths if args.from_audit else args.paths, args, audit_state, note)
    regenerated = set(counts.replaced) | counts.earlier
    suspect_now = sorted(p for p in regenerated if verdict.get(p) == SUSPECT)
    ok = {p for p in targeted if verdict.get(p) == OK or p in counts.right} | set(suspect_now)
    still_bad = sorted(p for p in targeted if p not in ok and p not in counts.skipped)
    print(
        f"repair: {len(counts.replaced)} regenerated this run, {len(counts.right)} right "
        f"after all (kept as they were); of {len(targeted)} targeted files {len(ok)} "
        f"are ok now, {len(still_bad)} still bad, {len(counts.skipped)} skipped",
    )
    for p, dist in sorted(counts.right.items()):
        how = "" if dist is None else f" (largest row difference {dist:.3f} < {files.TOLERANCE})"
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
    text = (
        "every targeted file is ok"
        if not still_bad and not counts.skipped
        else "NOT every targeted file is ok"
    )
    if not still_bad and not counts.skipped and suspect_now:
        text += f" ({len(suspect_now)} regenerated files the audit calls suspect, listed above)"
    print("result: " + text)
    return 0 if text.startswith("every") else 1
