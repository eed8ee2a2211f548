"""``vllm-hsfix audit PATH...``: find hidden-states files that a broken vLLM wrote.

The Python API, for generation pipelines (both need numpy; nothing here imports vLLM
or torch):

* :func:`check_file` ``(path) -> FileReport``: the per-file checks on one file, no
  dataset context (``verdict``: ``ok``, ``suspect``, ``corrupt``, ``unsupported`` for a
  format it does not know, or ``pending`` while the writer's ``.lock`` is there): check
  each file as it is written, requeue bad ones;
* :func:`audit_paths` ``(paths, workers=None, *, ray=None, state=None, on_record=None,
  keep=True, reference=None) -> AuditReport``: the whole audit, dataset checks included
  (``report.regenerate``: the corrupt files; ``report.suspect``; ``on_record`` receives
  the :mod:`.records` stream).

Modules, lowest first (each imports only modules above it in this list):

* ``prefix_columns``: where the prefix sketches wait for the dataset pass (on disk).
* ``blas``: one BLAS thread while a worker judges its files.
* ``prefix``: the shared-prefix consistency check (row sketches, consensus per group).
* ``reference``: ``--reference``: recompute a sample with transformers and compare.
* ``reports``: findings, the verdicts, per-file reports, per-run reports.
* ``ledger``: what the dataset pass keeps of every file, as columns.
* ``progress``: each pass's progress, tqdm on a terminal, plain lines in a log.
* ``records``: the run as a stream of JSON records (``--jsonl``).
* ``format``: the layouts the connectors write (plain, fp8): header, keys, dtypes, token ids.
* ``decode``: rows as values, in one place (fp8 de-quantized with its per-token scales).
* ``kernel``: the compiled per-row pass (numba) for large audits.
* ``window``: one window of a file's rows -> the few numbers per row the checks need.
* ``incremental``: ``--state``: per-file results kept between runs.
* ``repeats``: rows repeated across token ids or aux layers (keys confirmed on the rows).
* ``signatures``: which findings name a known hazard of the register.
* ``scan``: one file: header and keys, then every row streamed (``audit_file``).
* ``batched``: a worker's small files of one shape judged as one array (else ``scan``).
* ``wire``: a worker's reports on their way to the driver, as columns.
* ``parallel``: ``batched`` over many files in batches in worker processes.
* ``on_ray``: the same batches as Ray tasks across a cluster (``--ray``).
* ``dataset``: cross-file checks after the scan: shape majority, norm outliers, prefixes.
* ``pipeline``: ``audit_paths``: paths -> files -> scan -> dataset pass -> records.
* ``output``: the text summary, ``--list`` and the CSV file.
* ``command``: the argparse parser, the subcommand and its exit codes (``main``).

Only numpy and the standard library are used (never vllm, torch or safetensors: the
auditor must run on a bare data box; ``reference`` alone imports torch and transformers,
and only for ``--reference``; ``on_ray`` imports Ray, only for ``--ray``), and numpy is
imported lazily so that registering the subcommand keeps ``vllm-hsfix status`` as cheap
as before.
"""

from __future__ import annotations

from typing import Any

from .command import add_parser

__all__ = ["add_parser", "audit_paths", "check_file"]


def __getattr__(name: str) -> Any:
    # The API lives in ``pipeline``; importing it here eagerly would be cheap, but the
    # subcommand registration must stay the only cost of ``import vllm_hsfix.audit``.
    if name in ("audit_paths", "check_file"):
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
