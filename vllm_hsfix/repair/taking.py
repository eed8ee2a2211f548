"""What happens to each regenerated file: checked, compared with the old one, put in
place or kept out, and recorded.

The engine hands over a batch's files at once, so they are taken by a few threads (the
work is reads, numpy and fsync, which release the GIL): one batch of 256 small files
took 0.55 s one at a time. The outcome of each file (:func:`outcome`) touches only
that file; what is shared (the journal, the counts) is written by the caller's thread
(:meth:`Taker.drain`).
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..audit import format as fmt
from . import compare, replace
from .journal import Journal, sha256
from .targets import Target

THREADS = 4


class Counts:
    def __init__(self) -> None:
        self.replaced: list[str] = []
        self.skipped: dict[str, str] = {}  # path -> why
        self.refused: dict[str, str] = {}  # path -> why the new file was not installed
        self.right: dict[str, float | None] = {}  # path -> distance: old file kept, right
        self.earlier: set[str] = set()  # replaced by an earlier run (the journal says so)

    def skip(self, path: str, why: str) -> None:
        self.skipped[path] = why


def endpoint_stamp_problem(path: str) -> str | None:
    """``--endpoint``: the server's files must say vllm-hsfix made them (provenance)."""
    try:
        _, header, _, _, _ = fmt.read_layout(path)
    except (fmt.BadFile, OSError):
        return None  # unreadable: the replacement's own check refuses it, with the reason
    meta = header.get("__metadata__") or {}
    patches = meta.get("vllm_hsfix.patches")
    vllm = meta.get("vllm_hsfix.vllm", "")
    if patches is None:
        return (
            "the server's files carry no vllm-hsfix provenance: run vllm serve with "
            "vllm-hsfix installed and VLLM_HSFIX_PROVENANCE=1"
        )
    if patches == "none" and not _fixed_release(vllm):
        return f"the server (vLLM {vllm}) wrote a file with no vllm-hsfix patch applied"
    return None


def _fixed_release(version: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release >= (0, 25)
    except InvalidVersion:
        return False


def outcome(args: argparse.Namespace, t: Target, produced: str | None, root: str | None) -> Any:
    """One regenerated file's fate: ``("refused", why)``, ``("right", distance)`` (the
    old file agrees row by row and stays byte for byte: an audit false alarm) or
    ``("replaced", (sha256, size))``."""
    if produced is None:
        return "refused", "vLLM wrote no file for it"
    if args.endpoint:
        problem = endpoint_stamp_problem(produced)
        if problem:
            return "refused", problem
    try:
        replace.check_new(produced, t)
        dist = compare.distance(t.path, produced)
        if dist is not None and dist < compare.TOLERANCE:
            return "right", dist
        return "replaced", replace.install(produced, t, args.backup, root)
    except replace.Refused as exc:
        return "refused", str(exc)


class Taker:
    """Takes regenerated files on a few threads; :meth:`drain` records the outcomes."""

    def __init__(
        self, args: argparse.Namespace, root: str | None, journal: Journal, counts: Counts
    ) -> None:
        self.args, self.root, self.journal, self.counts = args, root, journal, counts
        self.pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="hsfix-take")
        self.pending: list[tuple[Target, Future[Any]]] = []

    def take(self, t: Target, produced: str | None) -> None:
        self.pending.append((t, self.pool.submit(outcome, self.args, t, produced, self.root)))

    def drain(self, wait: bool = False) -> list[Target]:
        """Record the finished outcomes (all of them with ``wait``), in the order taken;
        the targets recorded."""
        done: list[Target] = []
        while self.pending and (wait or self.pending[0][1].done()):
            t, fut = self.pending.pop(0)
            self._record(t, *fut.result())
            done.append(t)
        return done

    def _record(self, t: Target, kind: str, detail: Any) -> None:
        if kind == "refused":
            self.counts.refused[t.path] = detail
        elif kind == "right":
            self.counts.right[t.path] = detail
            self.journal.replaced(t.path, sha256(t.path), os.path.getsize(t.path), "right")
        else:
            digest, size = detail
            self.journal.replaced(t.path, digest, size)
            self.counts.replaced.append(t.path)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
