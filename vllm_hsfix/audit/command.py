"""``vllm-hsfix audit PATH...``: find hidden-states files that a broken vLLM wrote.

Exit codes: 0 no corrupt file (suspect, pending and unsupported files are listed but do
not fail the run), 1 at least one corrupt file, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from . import outfiles
from .format import SUFFIX
from .output import (
    CSV_FIELDS,
    DEFAULT_SHOW,
    LIST_KINDS,
    Digest,
    JsonlWriter,
    format_human,
    write_csv,
    write_list,
)
from .parallel import STALL_S, default_workers
from .pipeline import Reference, audit_paths, expand_paths
from .progress import DEFAULT_INTERVAL, SILENT, for_stream
from .reports import CORRUPT

CSV_HEAD = ",".join(CSV_FIELDS).encode()
SAMPLE = "0.05"  # --sample's default


def _show(value: str) -> int | None:
    if value == "all":
        return None
    n = int(value)
    if n < 0:
        raise ValueError
    return n


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``audit`` on an ``add_subparsers()`` object (``vllm_hsfix.cli`` and
    :func:`main` share it). Imports nothing heavy."""
    p = subparsers.add_parser(
        "audit",
        help="find hidden-states files written by a broken vLLM (exit 1: corrupt files)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="exit codes: 0 no corrupt file (suspect, pending and unsupported files are "
        "listed, not failed); 1 at least one corrupt file; 2 usage (no such path, nothing to "
        "audit, an output path that cannot be written or is not the audit's own, numpy or Ray "
        "missing, a run ended by --stall-timeout); 141 the reader of stdout went away.",
    )
    p.add_argument("paths", nargs="+", help="files or directories (searched for *.safetensors)")
    out = p.add_argument_group("outputs (any combination; at most one of them on stdout)")
    out.add_argument("--json", action="store_true", help="the whole report as one JSON document")
    out.add_argument("--csv", metavar="FILE", default=None, help="one row per file")
    out.add_argument(
        "--jsonl",
        metavar="FILE",
        default=None,
        help="stream one JSON record per file as it is judged, then updates, then a summary "
        "(- for stdout)",
    )
    out.add_argument(
        "--list",
        nargs=2,
        action="append",
        metavar=("KIND", "FILE"),
        default=[],
        help=f"one path per line of the files of KIND ({', '.join(LIST_KINDS)}; bad = "
        "corrupt + suspect) into FILE (- for stdout); repeatable",
    )
    out.add_argument(
        "--show",
        type=_show,
        default=DEFAULT_SHOW,
        metavar="N|all",
        help=f"files shown per check in the text summary (default {DEFAULT_SHOW})",
    )
    out.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    out.add_argument(
        "--progress-interval",
        type=float,
        default=DEFAULT_INTERVAL,
        metavar="S",
        help="seconds between progress lines when stderr is not a terminal "
        f"(default {DEFAULT_INTERVAL:g})",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help=f"worker processes (default min(4, CPUs) = {default_workers()})",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const=True,
        default=None,
        metavar="ADDRESS",
        help="scan on a Ray cluster (ADDRESS, else RAY_ADDRESS, else the local one); the "
        "files must be at the same path on every node",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=STALL_S,
        metavar="S",
        help="end the run (exit 2, naming the files) when no batch of files comes back for "
        f"S seconds: a read that never returns (default {STALL_S:g}; 0: wait forever)",
    )
    p.add_argument(
        "--state",
        metavar="FILE",
        default=None,
        help="keep per-file results here; a rerun scans only new or changed files",
    )
    ref = p.add_argument_group(
        "reference check (imports torch and transformers; nothing else does)"
    )
    ref.add_argument(
        "--reference",
        metavar="MODEL_DIR",
        default=None,
        help="recompute a sample of files with a transformers forward of the verifier",
    )
    ref.add_argument(
        "--aux-layers",
        default=None,
        help="the eagle_aux_hidden_state_layer_ids the files were written with, e.g. 1,2,3",
    )
    ref.add_argument(
        "--sample",
        default=None,
        help="fraction (0.1; 1.0 = every file) or number (20) of files to recompute (default 0.05)",
    )
    ref.add_argument(
        "--reference-dtype",
        choices=["float32", "model"],
        default="float32",
        help="forward in fp32 (default) or in the checkpoint's own dtype",
    )
    p.set_defaults(fn=run)
    return p


def _reference_usage(args: argparse.Namespace) -> str | None:
    """What is wrong with the ``--reference`` arguments (checked before the scan)."""
    from . import reference

    problem = reference.missing_dependency()
    if problem:
        return problem
    if not os.path.isfile(os.path.join(args.reference, "config.json")):
        return f"vllm-hsfix audit: --reference {args.reference} holds no config.json"
    try:
        aux = [int(a) for a in (args.aux_layers or "").split(",") if a.strip()]
        if not aux:
            return "vllm-hsfix audit: --reference needs --aux-layers (e.g. 1,2,3)"
        reference.sample(["x"], args.sample or SAMPLE)
    except ValueError as exc:
        return f"vllm-hsfix audit: {exc}"
    try:
        with open(os.path.join(args.reference, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        n = config.get("text_config", config).get("num_hidden_layers")
    except (OSError, ValueError, AttributeError):
        n = None  # the model's loader will say what is wrong with it
    bad = [k for k in aux if isinstance(n, int) and not 0 <= k <= n]
    if bad:
        return (
            f"vllm-hsfix audit: --aux-layers {bad}: {args.reference} has {n} decoder layers "
            f"(aux ids 0-{n}; {n} is the last layer's output before the final norm)"
        )
    return None


def _output_usage(args: argparse.Namespace) -> str | None:
    """Outputs that cannot work: two on stdout, an unknown ``--list`` kind."""
    on_stdout = (["--json"] if args.json else []) + (["--jsonl -"] if args.jsonl == "-" else [])
    for kind, dest in args.list:
        if kind not in LIST_KINDS:
            return f"vllm-hsfix audit: --list {kind}: KIND is one of {', '.join(LIST_KINDS)}"
        if dest == "-":
            on_stdout.append(f"--list {kind} -")
    if len(on_stdout) > 1:
        return f"vllm-hsfix audit: only one output can go to stdout, got {', '.join(on_stdout)}"
    return None


def _fanout(sinks: list[Callable[[dict[str, Any]], None]]) -> Callable[[dict[str, Any]], None]:
    def emit(record: dict[str, Any]) -> None:
        for sink in sinks:
            sink(record)

    return emit


def _usage(args: argparse.Namespace) -> str | None:
    """What makes the command unable to start (exit 2), before any work."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        hint = "pip install numpy threadpoolctl tqdm (the package's [audit] extra)"
        return f"vllm-hsfix audit needs numpy, which is not installed here: {hint}"
    problem = _output_usage(args) or (_reference_usage(args) if args.reference else None)
    if not problem and args.ray is not None:
        from .parallel import ray_missing

        problem = ray_missing()
    if problem:
        return problem
    if args.workers is not None and args.workers < 1:
        return f"vllm-hsfix audit: --workers must be >= 1, got {args.workers}"
    if not args.stall_timeout >= 0:
        return f"vllm-hsfix audit: --stall-timeout must be >= 0, got {args.stall_timeout}"
    return None


def _open_outputs(args: argparse.Namespace) -> JsonlWriter | None:
    """The ``--jsonl`` writer, once every output path is known to be writable and free
    of the user's files, before the scan (not after hours of it); nothing is written
    before. Raises ``OSError`` or ``outfiles.NotOurs``."""
    wanted = [("--list", d, outfiles.is_list, "a --list file") for _, d in args.list]
    wanted += [("--csv", args.csv, lambda line: line.startswith(CSV_HEAD), "an audit CSV")]
    wanted += [("--jsonl", args.jsonl, outfiles.is_records, "an audit's --jsonl output")]
    wanted += [("--state", args.state, outfiles.is_state, "an audit state file")]
    for option, dest, ours, what in wanted:
        if dest and dest != "-":
            outfiles.claim(dest, option, ours, what)
    return JsonlWriter(args.jsonl) if args.jsonl else None


def _say_reference(report: Any, model_dir: str, err: Any) -> None:
    ref = report.dataset.get("reference")
    if ref:
        print(
            f"reference: {ref['files_compared']} files recomputed with {model_dir} "
            f"({ref['dtype']}), {ref['files_wrong']} wrong; {ref['seconds_per_file']:.3f} s "
            f"per file after {ref['model_load_s']:.1f} s to load the model",
            file=err,
        )
        rules = ref.get("conventions", {})
        for slot, k in enumerate(ref.get("aux_layers", [])):  # one numbering: the slot's
            print(f"reference: aux slot {slot} (id {k}) = {rules.get(str(k))}", file=err)


def run(args: argparse.Namespace) -> int:
    """The ``audit`` subcommand: 0 no corrupt file, 1 corrupt files, 2 usage error (a
    missing dependency included: exit 1 must only ever mean "corrupt files found")."""
    err = sys.stderr
    problem = _usage(args)
    files: list[str] = []
    if not problem:
        try:
            files = expand_paths(args.paths)
        except FileNotFoundError as exc:
            problem = f"vllm-hsfix audit: {exc}"
    if not problem and not files:
        problem = f"vllm-hsfix audit: no {SUFFIX} files in {' '.join(args.paths)}"
    if problem:
        print(problem, file=err)
        return 2
    ignored = [o for o, v in (("--aux-layers", args.aux_layers), ("--sample", args.sample)) if v]
    if ignored and not args.reference:
        print(f"vllm-hsfix audit: warning: {' and '.join(ignored)} ignored: only --reference "
              "uses them", file=err)  # fmt: skip
    digest = Digest(args.show)
    jsonl = _open_outputs(args)
    sinks: list[Callable[[dict[str, Any]], None]] = [digest] + ([jsonl] if jsonl else [])
    reference = None
    if args.reference:
        aux = tuple(int(a) for a in args.aux_layers.split(",") if a.strip())
        reference = Reference(args.reference, aux, args.sample or SAMPLE, args.reference_dtype)
    progress = SILENT if args.no_progress else for_stream(err, args.progress_interval)
    try:
        report = audit_paths(
            files,
            workers=args.workers,
            progress=progress,
            ray=args.ray,
            state=args.state,
            on_record=_fanout(sinks),
            keep=bool(args.json or args.csv),
            reference=reference,
            stall_s=args.stall_timeout,
        )
    except RuntimeError as exc:
        print(f"vllm-hsfix audit: {exc}", file=err)
        return 2
    finally:
        if jsonl:
            jsonl.close()
    _say_reference(report, args.reference, err)
    if report.dataset.get("state_note"):
        print(report.dataset["state_note"], file=err)
    stdout_taken = args.json or args.jsonl == "-" or any(d == "-" for _, d in args.list)
    # The text summary goes to stdout unless a machine output has it; then to stderr.
    print(format_human(report, digest), file=err if stdout_taken else sys.stdout)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    for kind, dest in args.list:
        write_list(report, kind, dest)
    if args.csv:
        write_csv(report, args.csv)
        print(f"wrote {args.csv}", file=err if stdout_taken else sys.stdout)
    return 1 if report.count(CORRUPT) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry: ``main(["DIR", "--json"])`` is ``vllm-hsfix audit DIR --json``.

    Usage errors return 2 (argparse's code) instead of raising ``SystemExit``."""
    ap = argparse.ArgumentParser(prog="vllm-hsfix")
    add_parser(ap.add_subparsers(dest="cmd", required=True))
    try:
        args = ap.parse_args(["audit", *(sys.argv[1:] if argv is None else argv)])
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    return outfiles.run_guarded(args.fn, args)
