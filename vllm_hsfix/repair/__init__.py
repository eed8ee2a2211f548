"""``vllm-hsfix repair PATHS --model MODEL_DIR``: regenerate exactly the bad files.

Every file an affected vLLM wrote carries its own ``token_ids``: the input needed to
regenerate it exactly is already on disk. ``repair`` audits the dataset (or reads an
audit's output), runs the installed vLLM, with the fix verified active where it runs,
on each bad file's own token ids, and puts the new file in its place atomically, with
the same name, tensor names and dtype; then audits again.

Modules, lowest first:

* ``targets``: which files, and what each must keep (token ids, dtype, shape).
* ``journal``: ``--state``: what is done, for resuming.
* ``replace``: checking a regenerated file and putting it in place atomically.
* ``compare``: the regenerated file against the old one, row by row (right after all?).
* ``settings``: ``--engine-arg`` values, the engine settings the extraction ran with,
  the KV cache on vLLM's CPU build.
* ``guard``: the fix must be active before vLLM starts and where it runs.
* ``engine``: vLLM's offline engine, or a running ``vllm serve`` (``--endpoint``).
* ``_run``: the vLLM process of a repair (engine, in-engine guard, batches).
* ``command``: the subcommand, its flow and exit codes.
"""

from __future__ import annotations

from typing import Any

__all__ = ["add_parser"]


def add_parser(subparsers: Any) -> Any:
    """The ``repair`` subcommand (:mod:`.command`), imported only when asked for: the
    engine process (``python -m vllm_hsfix.repair._run``) then starts without its
    module imported twice."""
    from .command import add_parser as add

    return add(subparsers)
