"""Rows that repeat: one row at several token ids, one state in two aux layers; equal
cheap keys confirmed on the rows themselves."""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any

from .decode import Rows
from .reports import CORRUPT, SUSPECT, FileReport

if TYPE_CHECKING:
    from numpy.typing import NDArray


def duplicates(
    rep: FileReport,
    keys: NDArray[Any],
    skip: NDArray[Any],
    fd: int,
    offset: int,
    rows: Rows,
    token_ids: NDArray[Any],
) -> list[int]:
    """Count rows identical to a row of a *different token id* in the same aux layer.

    Same-token repeats are left alone: a layer close to the embeddings can legitimately
    give one token id the same vector at every position. Candidates (equal cheap keys)
    are re-read from ``fd`` and confirmed by a blake2b digest of the whole row's
    values."""
    import numpy as np

    n_aux = keys.shape[1]
    row_bytes = rows.row_bytes
    per_layer = [0] * n_aux
    if not skip.any():  # nearly every file: one sort says no key repeats in any layer
        srt = np.sort(keys, axis=0)
        if not (srt[1:] == srt[:-1]).any():
            return per_layer
    examples: list[str] = []
    for a in range(n_aux):
        pos = np.flatnonzero(~skip[:, a])
        k = keys[pos, a]
        order = np.argsort(k, kind="stable")
        ks = k[order]
        same = ks[1:] == ks[:-1]
        if not same.any():
            continue
        cand = np.zeros(len(ks), dtype=bool)
        cand[1:] |= same
        cand[:-1] |= same
        groups: dict[bytes, list[int]] = {}
        for t in pos[order[cand]].tolist():
            data = os.pread(fd, row_bytes, offset + (t * n_aux + a) * row_bytes)
            data = rows.canonical(data, t)
            digest = hashlib.blake2b(data, digest_size=16).digest()
            groups.setdefault(digest, []).append(t)
        for ts in groups.values():
            if len(ts) > 1 and len({int(token_ids[t]) for t in ts}) > 1:
                per_layer[a] += len(ts) - 1
                if len(examples) < 3:
                    examples.append(f"aux {a}: token positions {sorted(ts)[:4]}")
    total = sum(per_layer)
    if total:
        rep.add(
            "duplicate_rows",
            SUSPECT,
            f"{total} rows repeat a row of a different token in the same aux layer "
            f"(e.g. {'; '.join(examples)})",
        )
    return per_layer


def identical_aux(
    rep: FileReport,
    keys: NDArray[Any],
    skip: NDArray[Any],
    fd: int,
    offset: int,
    row_bytes: int,
) -> None:
    """Two aux layers holding the same row at every token position: one state saved
    into two slots (two different layers of a real model never agree everywhere).
    Equal keys at every sound position, confirmed byte for byte on the first and last
    of them."""
    import numpy as np

    n_tokens, n_aux = keys.shape  # one token's rows share a scale: bytes suffice
    if n_aux < 2 or n_tokens < 2:
        return
    pairs = [(a, b) for a in range(n_aux) for b in range(a + 1, n_aux)]
    if not skip.any():  # every row sound: only layers whose first keys agree can match
        first = keys[0].tolist()
        pairs = [(a, b) for a, b in pairs if first[a] == first[b]]
    for a, b in pairs:
        sound = np.flatnonzero(~(skip[:, a] | skip[:, b]))
        if len(sound) < 2 or not (keys[sound, a] == keys[sound, b]).all():
            continue
        same = all(
            os.pread(fd, row_bytes, offset + (t * n_aux + a) * row_bytes)
            == os.pread(fd, row_bytes, offset + (t * n_aux + b) * row_bytes)
            for t in (int(sound[0]), int(sound[-1]))
        )
        if same:
            rep.add(
                "aux_layers_identical",
                CORRUPT,
                f"aux layers {a} and {b} hold identical rows at all {len(sound)} "
                "token positions (unless the file was written with one aux layer id "
                "twice)",
            )
            return
