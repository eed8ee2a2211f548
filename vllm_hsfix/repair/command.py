"""``vllm-hsfix repair PATHS --model MODEL_DIR``: regenerate exactly the bad files.

The targets (an audit, or ``--from-audit``; :mod:`.files`), the engine settings
(:mod:`.settings`), the guard (:mod:`.guard`), one vLLM process per file format
(:mod:`.session`); then a re-audit and the verdicts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any

from .. import detect
from ..audit import outfiles
from . import files, settings
from .files import OK, SUSPECT, Fates, Journal, Target
from .session import regenerate, stop

DEFAULT_STATE = ".vllm-hsfix-repair.jsonl"
EPILOG = """\
exit codes: 0 every targeted file is ok now (or nothing needed repair; --dry-run);
1 a targeted file is still bad or was skipped, the vLLM run failed, or the fix is not
active where vLLM runs (then nothing is written); 2 usage (no such path, no model, no
aux layers known, a bad --shard or --engine-arg, an engine argument vLLM rejects, a
--state, --from-audit or --backup path that cannot be used or is not its own: then
nothing is written); 141 the reader of stdout went away.

several machines: run `repair --shard K/N` on each (K = 0..N-1, the same PATHS or
--from-audit file): each takes every N-th target of the sorted list from the K-th, so
the machines split the work without talking to each other; give each its own --state
(the journal, and the audit state beside it). A verifier larger than one machine:
vLLM's own Ray backend, e.g. --tensor-parallel-size 16 --engine-arg
distributed_executor_backend=ray on a node of a running Ray cluster (RAY_ADDRESS).

the repair's vLLM process (python -m vllm_hsfix.repair.engine) reports on its stdout,
one JSON object per line (vLLM's own output goes to the log, stderr):
  {"event": "bad_arg", "key": K, "why": W}  vLLM rejects engine argument K (exit 2)
  {"event": "guard", "problems": [...]}     the engine started; problems: the fix is
                                            not active there (exit 3)
  {"event": "file", "index": I, "path": P}  prompt I's new file (P null: none)
  {"event": "done"}                         every prompt answered
it exits 4 when the repair is gone between batches, 5 when vLLM's engine core died
under it and vLLM did not end the run; a line cut short by a kill is ignored.
"""


def parse_aux_layers(text: str) -> tuple[int, ...]:
    """``1,2,3`` -> (1, 2, 3)."""
    try:
        return tuple(int(a) for a in text.split(",") if a.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers, e.g. 1,2,3, got {text}") from None


def parse_shard(spec: str) -> tuple[int, int]:
    """``K/N`` -> (K, N) with 0 <= K < N."""
    k, _, n = spec.partition("/")
    if not (k.isdigit() and n.isdigit() and int(k) < int(n)):
        raise argparse.ArgumentTypeError(f"expected K/N with 0 <= K < N, got {spec}")
    return int(k), int(n)


def shard(paths: list[str], spec: tuple[int, int] | None) -> list[str]:
    """(K, N): every N-th path of the sorted list from the K-th, so N machines given the
    same input split it without talking to each other."""
    if spec is None:
        return paths
    return [p for i, p in enumerate(sorted(paths)) if i % spec[1] == spec[0]]


def _positive(text: str) -> int:
    """A whole number of at least 1 (``--batch-size``)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return int(text)


OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("--model", {"metavar": "MODEL_DIR", "help": "required (except with --dry-run or "
                 "--endpoint): the verifier the dataset was made with (a local dir)"}),
    ("--aux-layers", {"type": parse_aux_layers, "help": "eagle_aux_hidden_state_layer_ids, "
                      "e.g. 1,2,3 (else from the files' provenance metadata)"}),
    ("--from-audit", {"metavar": "FILE", "help": "an audit's --jsonl or --list output"}),
    ("--include-suspect", {"action": "store_true", "help": "regenerate suspect files too"}),
    ("--backup", {"metavar": "DIR", "help": "keep each old file here before replacing it"}),
    ("--state", {"metavar": "FILE", "default": DEFAULT_STATE,
                 "help": f"journal of replaced files, for resuming (default ./{DEFAULT_STATE})"}),
    ("--dry-run", {"action": "store_true", "help": "list what would be regenerated"}),
    ("--batch-size", {"type": _positive, "default": 256, "help": "prompts per engine batch"}),
    ("--max-model-len", {"type": int}),
    ("--tensor-parallel-size", {"type": int, "default": 1}),
    ("--data-parallel-size", {"type": int, "default": 1}),
    ("--engine-arg", {"type": settings.parse_engine_arg, "action": "append", "default": [],
                      "metavar": "KEY=VALUE",
                      "help": "more vllm.LLM keyword arguments, e.g. dtype=bfloat16 or "
                      "enforce_eager=true (VALUE is JSON when it parses, else a string; "
                      "repeatable; overrides the settings read from the files' provenance "
                      "or derived from the checkpoint)"}),
    ("--endpoint", {"metavar": "URL", "help": "use this running vllm serve instead"}),
    ("--shard", {"type": parse_shard, "metavar": "K/N",
                 "help": "only every N-th target from the K-th"}),
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
    # --model is required but for --dry-run and --endpoint: shown without brackets.
    usage = p.format_usage().removeprefix("usage: ").replace(p.prog, "%(prog)s", 1)
    p.usage = usage.replace("[--model MODEL_DIR]", "--model MODEL_DIR").strip()
    p.set_defaults(fn=run)
    return p


def _usage(args: argparse.Namespace) -> str | None:
    missing = [p for p in args.paths if not os.path.exists(p)]
    if missing:
        return f"no such file or directory: {missing[0]}"
    needs_model = not args.dry_run and not args.endpoint
    if needs_model and not args.model:
        return "--model MODEL_DIR is required (unless --dry-run or --endpoint)"
    if needs_model and not os.path.isfile(os.path.join(args.model, "config.json")):
        return f"--model {args.model}: no config.json there (missing model)"
    backup = args.backup
    if backup and os.path.exists(backup) and not os.path.isdir(backup):
        return f"--backup {backup}: exists and is not a directory"
    if backup and os.path.isdir(backup) and not os.access(backup, os.W_OK | os.X_OK):
        return f"--backup {backup}: cannot write there"
    return None


def _aux(args: argparse.Namespace, targets: list[Target]) -> tuple[int, ...] | str:
    """The aux layers: ``--aux-layers``, else the one set the files' provenance names."""
    if args.aux_layers or not targets:
        return args.aux_layers or ()
    stamped = sorted({t.aux_layers for t in targets if t.aux_layers})
    if len(stamped) == 1:
        return stamped[0]
    if stamped:
        return f"the files' provenance names different aux layers {stamped}: pass --aux-layers"
    return (
        "the aux layers are not known: pass --aux-layers (the files carry no "
        "vllm_hsfix.aux_layers provenance metadata)"
    )


def run(args: argparse.Namespace) -> int:
    problem = _usage(args)
    if problem:
        return stop(problem, 2)
    audit_state = args.state + ".audit"
    journal, fates = Journal(args.state), Fates()  # both paths checked before any work
    had_state = outfiles.claim(audit_state, "--state", outfiles.is_state, "an audit state")
    if args.from_audit:
        paths = files.from_audit_output(args.from_audit, args.include_suspect)
    else:
        verdicts = files.audit(args.paths, args, audit_state)
        paths = [p for p, v in verdicts.items() if v in files.wanted(args.include_suspect)]
    paths = shard(paths, args.shard)
    targets = _targets(paths, journal, fates)
    aux = _aux(args, targets)
    if isinstance(aux, str):
        if not had_state:  # a run that stops on its usage leaves nothing behind
            with contextlib.suppress(FileNotFoundError):
                os.unlink(audit_state)
        return stop(aux, 2)
    engine, said, targets = _engine(args, targets, aux, fates)
    _plan(paths, targets, fates, journal)
    if said:
        print(f"repair: {said}", file=sys.stderr)
    if args.dry_run:
        for t in targets:
            print(f"{t.path}\t{t.tokens} tokens")
        for p, why in fates.of("skipped").items():
            print(f"# skip {p}: {why}")
        print(f"would regenerate {len(targets)} files, {sum(t.tokens for t in targets)} tokens")
        return 0
    for fp8 in sorted({t.fp8 for t in targets}):  # one engine per file format
        group = [t for t in targets if t.fp8 == fp8]
        status = regenerate(args, group, {**engine, "fp8": fp8}, journal, fates)
        if status is not None:
            return status
    return finish(args, paths, fates, audit_state)


def _targets(paths: list[str], journal: Journal, fates: Fates) -> list[Target]:
    """The targets to regenerate; those an earlier run finished, or that cannot be
    regenerated, go to ``fates``."""
    out = []
    for p in paths:
        if journal.is_done(p):  # an earlier run replaced it, or found it right and kept it
            fates[p] = ("right" if journal.done[p]["status"] == "right" else "earlier", None)
        elif (t := files.read_target(p)).problem:
            fates[p] = ("skipped", t.problem)
        else:
            out.append(t)
    return out


def _engine(
    args: argparse.Namespace, targets: list[Target], aux: tuple[int, ...], fates: Fates
) -> tuple[dict[str, Any], str | None, list[Target]]:
    """The engine's settings, where they came from, and the targets that can run under
    them (the others are skipped)."""
    max_len = args.max_model_len or max(16, max((t.tokens for t in targets), default=0) + 2)
    engine_args: dict[str, Any] = dict(args.engine_arg)
    said = None
    if targets and not args.endpoint:
        cpu_build = bool(detect.detect().cpu_build)
        engine_args, max_len, said = settings.engine_settings(args, targets, cpu_build, max_len)
    kept = []
    for t in targets:
        if t.n_aux is not None and t.n_aux != len(aux):
            fates[t.path] = ("skipped", f"the file has {t.n_aux} aux layers, --aux-layers "
                             f"gives {len(aux)}")  # fmt: skip
        elif t.tokens + 1 > max_len:
            fates[t.path] = ("skipped", f"{t.tokens} tokens do not fit --max-model-len {max_len}")
        else:
            kept.append(t)
    return {"aux": list(aux), "max_len": max_len, "engine_args": engine_args}, said, kept


def _plan(paths: list[str], targets: list[Target], fates: Fates, journal: Journal) -> None:
    right = journal.count("right")
    print(
        f"repair: {len(paths)} targeted files, {len(targets)} to regenerate "
        f"({sum(t.tokens for t in targets)} tokens), {len(fates.of('skipped'))} skipped, "
        f"{len(fates.of('earlier')) + len(fates.of('right'))} already repaired by an earlier run "
        f"(the journal holds {journal.count('replaced')} replaced files"
        + (f" and {right} right after all" if right else "")
        + ")",
        file=sys.stderr,
    )


def finish(args: argparse.Namespace, paths: list[str], fates: Fates, audit_state: str) -> int:
    """Audit again (unchanged files come from the audit state) and say how every targeted
    file ended. A file right after all is ok whatever the audit says of it now; so is a
    regenerated file the audit only calls suspect (named, with why)."""
    targeted = set(paths)
    why_suspect: dict[str, str] = {}

    def note(record: dict[str, Any]) -> None:
        found = [p for p in record.get("problems", []) if p.get("severity") == SUSPECT]
        if record.get("path") in targeted and record.get("verdict") == SUSPECT and found:
            why_suspect[record["path"]] = f"{found[0]['code']}: {found[0]['detail']}"

    verdict = files.audit(paths if args.from_audit else args.paths, args, audit_state, note)
    right, skipped = fates.of("right"), fates.of("skipped")
    regenerated = {*fates.of("replaced"), *fates.of("earlier")}
    suspect_now = sorted(p for p in regenerated if verdict.get(p) == SUSPECT)
    ok = {p for p in targeted if verdict.get(p) == OK or p in right} | set(suspect_now)
    still_bad = sorted(targeted - ok - skipped.keys())
    print(
        f"repair: {len(fates.of('replaced'))} regenerated this run, {len(right)} right "
        f"after all (kept as they were); of {len(targeted)} targeted files {len(ok)} "
        f"are ok now, {len(still_bad)} still bad, {len(skipped)} skipped",
    )
    for p, dist in sorted(right.items()):
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
        why = fates.of("refused").get(p) or f"audit says {verdict.get(p)} after regeneration"
        print(f"  still bad {p}: {why}")
    for p, why in sorted(skipped.items()):
        print(f"  skipped {p}: {why}")
    if still_bad or skipped:
        print("result: NOT every targeted file is ok")
        return 1
    flagged = f" ({len(suspect_now)} regenerated files the audit calls suspect, listed above)"
    print("result: every targeted file is ok" + (flagged if suspect_now else ""))
    return 0
