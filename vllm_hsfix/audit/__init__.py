"""``vllm-hsfix audit PATH...``: find hidden-states files that a broken vLLM wrote.

Modules, lowest first (each imports only modules above it in this list):

* ``prefix``: the shared-prefix consistency check (row sketches, consensus per group).
* ``reference``: ``--reference``: recompute a sample with transformers and compare.
* ``reports``: findings, the three verdicts, per-file and per-run reports.
* ``format``: the safetensors layout the connector writes: header, keys, dtypes, token ids.
* ``scan``: one file: header and keys, then every row streamed (``audit_file``).
* ``parallel``: ``audit_file`` over many files in worker processes; dead workers.
* ``dataset``: cross-file checks after the scan: shape majority, norm outliers, prefixes.
* ``pipeline``: ``audit_paths``: paths -> files -> parallel scan -> dataset pass.
* ``output``: the progress bar, the human summary and the CSV file.
* ``command``: the argparse parser, the subcommand and its exit codes (``main``).

Only numpy and the standard library are used (never vllm, torch or safetensors: the
auditor must run on a bare data box; ``reference`` alone imports torch and transformers,
and only for ``--reference``), and numpy is imported lazily so that registering the
subcommand keeps ``vllm-hsfix status`` as cheap as before.
"""

from .command import add_parser

__all__ = ["add_parser"]
