"""Many small files of one shape judged together: their rows through the checks as one
array, cut back into files at the end; a file with an all-zero, non-finite or repeating
row is judged again alone by the per-file path, so every verdict is that path's."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from . import decode, prefix
from .reports import FileReport
from .scan import (
    NEAR_ZERO_FRACTION,
    Prepared,
    conclude,
    guarded,
    locked,
    near_zero,
    prepare,
    scan_rows,
    sound_layer_stats,
)

# A group holds at most this many bytes of rows, so its arrays stay in the CPU's caches
# (only files read whole, :data:`.scan.WHOLE_FILE_BYTES`, take the group pass).
MAX_GROUP_BYTES = 1024 * 1024
# Stored row formats the group pass takes (fp8 rows carry per-file scales, F64 is rare:
# those go through the per-file path).
DTYPES = ("BF16", "F16", "F32")

Item = tuple[int, FileReport, Prepared, float]  # input index, report, prepared, start time


def audit_files(paths: Sequence[str]) -> list[FileReport]:
    """The per-file verdicts of ``paths`` (as :func:`.scan.audit_file` gives them, in
    order; ``pending`` for a file its writer still holds)."""
    out: list[FileReport | None] = [None] * len(paths)
    groups: dict[tuple[str, int, int], tuple[list[Item], list[int]]] = {}
    for i, path in enumerate(paths):
        pending = locked(path)
        if pending is not None:
            out[i] = pending
            continue
        t0 = time.perf_counter()
        rep = FileReport(path=path)
        prep = guarded(rep, prepare, rep, path)
        if prep is None or not _takes(rep, prep):
            if prep is not None:
                guarded(rep, scan_rows, rep, prep)
            out[i] = conclude(rep, t0)
            continue
        key = (prep.rows.dtype, prep.shape[1], prep.shape[2])
        items, size = groups.setdefault(key, ([], [0]))
        items.append((i, rep, prep, t0))
        size[0] += prep.shape[0] * prep.rows.n_aux * prep.rows.row_bytes
        if size[0] >= MAX_GROUP_BYTES:
            _judge(items, out)
            del groups[key]
    for items, _ in groups.values():
        _judge(items, out)
    return out  # type: ignore[return-value]


def _takes(rep: FileReport, prep: Prepared) -> bool:
    """Whether the group pass can judge this file: small, read whole, a plain format,
    nothing found in its header, a token id per token."""
    n_tokens = prep.shape[0]
    return (
        prep.whole is not None
        and not rep.problems
        and prep.rows.dtype in DTYPES
        and n_tokens > 0
        and prep.token_ids is not None
        and len(prep.token_ids) == n_tokens
    )


def _judge(items: list[Item], out: list[FileReport | None]) -> None:
    """Judge one group; the files it cannot judge go through the per-file path, and all
    it had not finished should it fail (a fault here costs time, never a verdict)."""
    t0 = items[0][3]
    done = [False] * len(items)
    try:
        alone, fresh = _group_pass(items, done), False
    except Exception:  # the per-file path judges (and reports) each file
        alone, fresh = {k for k, d in enumerate(done) if not d}, True
    share = (time.perf_counter() - t0) / len(items)
    for k, (i, rep, prep, _) in enumerate(items):
        if k not in alone:
            out[i] = conclude(rep, t0)
            rep.seconds = share  # the group's time, shared out
            continue
        t = time.perf_counter()
        if fresh:  # the failed pass may have left part of its work in the report
            rep = FileReport(path=rep.path)
            prep = guarded(rep, prepare, rep, rep.path)  # type: ignore[assignment]
        if prep is not None:
            guarded(rep, scan_rows, rep, prep)
        out[i] = conclude(rep, t)


def _group_stats(norms: Any, tokens: Any, tok_start: Any, owner: Any) -> list[list[Any]]:
    """Every file's per-layer median, mean, standard deviation, minimum, maximum and
    near-zero count ([files][n_aux] each) from ``norms`` [all tokens, n_aux]."""
    import numpy as np

    n_files, n_aux = len(tokens), norms.shape[1]
    aux = np.tile(np.arange(n_aux), len(norms))
    who = np.repeat(owner, n_aux)
    srt = norms.ravel()[np.lexsort((norms.ravel(), aux, who))]
    run = np.repeat(tokens, n_aux)
    seg = np.repeat(tok_start * n_aux, n_aux) + np.tile(np.arange(n_aux), n_files) * run
    mid = seg + run // 2
    odd = run % 2 == 1
    med = np.where(odd, srt[mid], (srt[mid - 1 + odd] + srt[mid]) / 2).reshape(n_files, n_aux)
    lo = srt[seg].reshape(n_files, n_aux)
    hi = srt[seg + run - 1].reshape(n_files, n_aux)
    mean = np.add.reduceat(norms, tok_start, axis=0) / tokens[:, None]
    dev = norms - mean[owner]
    dev *= dev
    std = np.sqrt(np.add.reduceat(dev, tok_start, axis=0) / tokens[:, None])
    near = np.add.reduceat(norms < NEAR_ZERO_FRACTION * med[owner], tok_start, axis=0)
    return [x.tolist() for x in (med, mean, std, lo, hi, near)]


def _group_heads(raw: Any, rows: Any, tokens: Any, tok_start: Any, n_aux: int) -> tuple[Any, ...]:
    """The prefix sketches of every file's first rows, one product for all: each file's
    head length and start in them, the unit sketches, their norms and soundness."""
    import numpy as np

    hidden = raw.shape[1]
    heads = np.minimum(tokens, prefix.PREFIX_ROWS)
    head_start = np.zeros(len(tokens), dtype=np.int64)
    np.cumsum(heads[:-1], out=head_start[1:])
    pick = np.arange(int(heads.sum())) + np.repeat(tok_start - head_start, heads)
    head_raw = raw.reshape(-1, n_aux, hidden)[pick].reshape(-1, hidden)
    values = rows.block(head_raw, 0, rows.buffer(len(head_raw)))[0]
    sound = np.ones((len(pick), n_aux), dtype=bool)
    unit, sk_norms, sound = prefix.sketch_heads(values.reshape(-1, n_aux, hidden), sound)
    return heads, head_start, unit, sk_norms, sound


def _group_pass(items: list[Item], done: list[bool]) -> set[int]:
    """The row checks of every file of ``items`` (one dtype, n_aux, hidden), written
    into their reports (``done[k]`` once file ``k``'s are); returns the positions of the
    files left to the per-file path."""
    import numpy as np

    first = items[0][2]
    rows, (_, n_aux, hidden) = first.rows, first.shape
    tokens = np.array([p.shape[0] for _, _, p, _ in items], dtype=np.int64)
    n_files = len(items)
    raw = np.concatenate(
        [
            np.frombuffer(p.whole[1], rows.raw_dtype, p.shape[0] * n_aux * hidden,  # type: ignore[index]
                          p.offset - p.whole[0])  # type: ignore[index]
            for _, _, p, _ in items
        ]
    ).reshape(-1, hidden)  # fmt: skip
    nums = decode.RowNumbers(len(raw), 0, hidden)
    cols, mult = decode.key_columns(hidden)
    decode.fill(nums, raw, rows, 0, cols, mult)

    # [all tokens, n_aux] per-token views; which file each token is of.
    tok_start = np.zeros(n_files, dtype=np.int64)
    np.cumsum(tokens[:-1], out=tok_start[1:])
    owner = np.repeat(np.arange(n_files), tokens)
    keys = nums.keys.reshape(-1, n_aux)
    unsound = (nums.zero | nums.bad).reshape(-1, n_aux).any(axis=1)
    alone = np.add.reduceat(unsound, tok_start) > 0
    # Repeat candidates: equal keys within one file and aux layer (a duplicate row),
    # or two aux layers with equal keys at every token (identical layers).
    aux = np.tile(np.arange(n_aux), len(keys))
    who = np.repeat(owner, n_aux)
    order = np.lexsort((keys.ravel(), aux, who))
    k_s, a_s, w_s = keys.ravel()[order], aux[order], who[order]
    same = (k_s[1:] == k_s[:-1]) & (a_s[1:] == a_s[:-1]) & (w_s[1:] == w_s[:-1])
    alone[w_s[1:][same]] = True
    for a in range(n_aux):
        for b in range(a + 1, n_aux):
            alone |= np.logical_and.reduceat(keys[:, a] == keys[:, b], tok_start)

    columns = _group_stats(np.sqrt(nums.sumsq).reshape(-1, n_aux), tokens, tok_start, owner)
    heads, head_start, unit, sk_norms, sound = _group_heads(raw, rows, tokens, tok_start, n_aux)
    no_dups = [0] * n_aux
    lists = (alone.tolist(), tokens.tolist(), heads.tolist(), head_start.tolist())
    per_file = zip(*lists, strict=True)
    for k, (skip, n, h, s) in enumerate(per_file):
        if skip:
            continue
        rep, prep = items[k][1], items[k][2]
        rep.layers = sound_layer_stats(n, *(c[k] for c in columns), no_dups)
        rep.prefix = prefix.PrefixData(
            tuple(prep.token_ids[:h].tolist()),  # type: ignore[index]
            unit[s : s + h],
            sk_norms[s : s + h],
            sound[s : s + h],
            (n_aux, hidden),
        )
        near_zero(rep)
        done[k] = True
    return set(np.flatnonzero(alone).tolist())
