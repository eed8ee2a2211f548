"""``vllm-hsfix audit PATH...``: find hidden-states files that a broken vLLM wrote.

The Python API (numpy only; nothing here imports vLLM or torch):

* :func:`check_file` ``(path) -> FileReport``: the per-file checks on one file, no
  dataset context (``verdict``: ``ok``, ``suspect``, ``corrupt``, ``unsupported`` or
  ``pending``): for a generation loop checking each file as it writes it;
* :func:`audit_paths` ``(paths, workers=None, *, ray=None, state=None, on_record=None,
  keep=True, reference=None) -> AuditReport``: the whole audit, dataset checks included.

The flow: ``pipeline`` expands the paths, ``parallel`` (or ``on_ray``) runs ``batched``
and ``scan`` over them (``format`` parses, ``decode`` turns rows into values, ``window``
and ``kernel`` reduce them, ``repeats`` and ``prefix`` look across rows), ``dataset``
runs the cross-file checks over ``ledger`` and ``prefix_columns``, ``records`` and
``output`` show the result, ``store`` keeps ``--state``. Only ``reference`` imports
torch and transformers (``--reference``), only ``on_ray`` Ray (``--ray``), only
``kernel`` numba (large audits); numpy is imported lazily, so registering the
subcommand costs nothing.
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
