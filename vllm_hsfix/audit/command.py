"""``vllm-hsfix audit PATH...``: find hidden-states files that a broken vLLM wrote.

vLLM 0.17.0-0.24.x (see README) can save ``extract_hidden_states`` files whose rows are
all zero or copied from other memory: the draft model trains "fine" on them and then
accepts ~0% of tokens. Patching vLLM stops new damage; this auditor finds the damage
already on disk, so only the bad files are regenerated.

Exit codes of ``vllm-hsfix audit``: 0 no corrupt file (suspect files are listed, and are
in the ``--json`` ``regenerate`` list, but do not fail the run: their checks are
heuristics, and a training job should not stop on a heuristic); 1 at least one corrupt
file; 2 usage error (a path that does not exist, ``--workers`` < 1, nothing to audit,
the ``--csv`` file cannot be written, numpy missing).

This module holds the argparse parser (:func:`add_parser`, shared by ``vllm_hsfix.cli``
and :func:`main`), the subcommand itself (:func:`run`) and its exit codes; it imports
nothing heavy, and :mod:`.reference` (torch, transformers) only for ``--reference``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from .format import SUFFIX
from .output import ProgressBar, format_human, write_csv
from .parallel import default_workers
from .pipeline import audit_paths, expand_paths
from .reports import CORRUPT, AuditReport


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``audit`` on an ``add_subparsers()`` object (``vllm_hsfix.cli`` and
    :func:`main` share it). Imports nothing heavy."""
    p = subparsers.add_parser(
        "audit",
        help="find hidden-states files written by a broken vLLM (exit 1: corrupt files)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("paths", nargs="+", help="files or directories (searched for *.safetensors)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="full report as JSON on stdout")
    out.add_argument("--csv", metavar="FILE", default=None, help="also write one row per file")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help=f"worker processes (default min(4, CPUs) = {default_workers()})",
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
        default="0.05",
        help="fraction (0.1) or number (20) of files to recompute (default 0.05)",
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
        reference.sample(["x"], args.sample)
    except ValueError as exc:
        return f"vllm-hsfix audit: {exc}"
    return None


def _reference_pass(report: AuditReport, args: argparse.Namespace) -> None:
    """``--reference``: recompute a sample; mismatching files become corrupt."""
    from . import reference

    err = sys.stderr
    aux = [int(a) for a in args.aux_layers.split(",") if a.strip()]
    readable = [f.path for f in report.files if f.n_tokens]
    if not readable:
        return None
    results, summary = reference.check(
        readable, args.reference, aux, args.sample, args.reference_dtype
    )
    by_path = {f.path: f for f in report.files}
    for r in results:
        if not r.ok:
            by_path[r.path].add("reference_mismatch", CORRUPT, r.describe(args.reference))
    report.dataset["reference"] = summary
    print(
        f"reference: {summary['files_compared']} files recomputed with {args.reference} "
        f"({summary['dtype']}), {summary['files_wrong']} wrong; "
        f"{summary['seconds_per_file']:.3f} s per file after {summary['model_load_s']:.1f} s "
        "to load the model",
        file=err,
    )


NEEDS = "numpy"
INSTALL_HINT = "pip install 'vllm-hsfix[audit]'"


def missing_dependency() -> str | None:
    """The one-line message when what ``audit`` needs is not installed, else None."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        return f"vllm-hsfix audit needs {NEEDS}, which is not installed here: {INSTALL_HINT}"
    return None


def run(args: argparse.Namespace) -> int:
    """The ``audit`` subcommand: 0 no corrupt file, 1 corrupt files, 2 usage error (a
    missing dependency included: exit 1 must only ever mean "corrupt files found")."""
    err = sys.stderr
    problem = missing_dependency() or (_reference_usage(args) if args.reference else None)
    if problem:
        print(problem, file=err)
        return 2
    if args.workers is not None and args.workers < 1:
        print(f"vllm-hsfix audit: --workers must be >= 1, got {args.workers}", file=err)
        return 2
    try:
        files = expand_paths(args.paths)
    except FileNotFoundError as exc:
        print(f"vllm-hsfix audit: {exc}", file=err)
        return 2
    if not files:
        print(f"vllm-hsfix audit: no {SUFFIX} files in {' '.join(args.paths)}", file=err)
        return 2
    bar = ProgressBar(err) if err.isatty() or len(files) > 50 else None
    try:
        report = audit_paths(files, workers=args.workers, progress=bar)
    except RuntimeError as exc:
        print(f"vllm-hsfix audit: {exc}", file=err)
        return 2
    finally:
        if bar:
            bar.close()
    if args.reference:
        _reference_pass(report, args)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_human(report))
    if args.csv:
        try:
            write_csv(report, args.csv)
        except OSError as exc:
            print(f"vllm-hsfix audit: cannot write {args.csv}: {exc.strerror or exc}", file=err)
            return 2
        print(f"wrote {args.csv}")
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
    return int(args.fn(args))
