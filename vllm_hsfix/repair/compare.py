"""Is the old file right after all? The regenerated file against it, row by row.

An audit can flag a right file (a prefix group with no consensus flags every member,
right ones too). Regenerating it with the fixed vLLM gives the answer: where every row
(token x aux layer) of the old file agrees with the new one within the audit's own
tolerance (``audit.prefix.TOLERANCE``, symmetric relative L2: bf16 batch noise is
under 0.07, wrong rows 1.0 and more), the old file is right and stays byte for byte.
A zero or NaN row in either file never agrees. Rows are read as the audit reads them
(``audit.decode.read_rows``: fp8 files de-quantized).
"""

from __future__ import annotations

from typing import Any

from ..audit import decode
from ..audit import format as fmt
from ..audit.prefix import TOLERANCE

__all__ = ["HEAD_TOKENS", "TOLERANCE", "distance", "hidden_rows"]

# Token positions compared before the whole file (see :func:`distance`).
HEAD_TOKENS = 16


def hidden_rows(path: str, tokens: int | None = None) -> Any | None:
    """``hidden_states`` as values, float32 [tokens, n_aux, hidden] (an fp8 file's
    de-quantized, as the audit reads it; ``tokens``: only the first that many); None
    where the audit cannot read it."""
    try:
        rows, _, _ = decode.read_rows(path, tokens)
    except (fmt.BadFile, OSError, ValueError):
        return None
    return rows


def distance(old_path: str, new_path: str) -> float | None:
    """The largest row distance between the two files' hidden states; None when they
    cannot agree (unreadable, other shapes, a zero or non-finite row in either).

    The first ``HEAD_TOKENS`` positions are compared first: a file repair targets is
    nearly always wrong from its first rows (zeros, other blocks' memory), and then
    that distance is the answer and the rest is not read (a fifth of repair's own
    time on a 256-file batch went into reading and widening whole files)."""
    head = _distance(hidden_rows(old_path, HEAD_TOKENS), hidden_rows(new_path, HEAD_TOKENS))
    if head is None or head >= TOLERANCE:
        return head
    return _distance(hidden_rows(old_path), hidden_rows(new_path))


def _distance(old: Any, new: Any) -> float | None:
    import numpy as np

    if old is None or new is None or old.shape != new.shape or not old.size:
        return None
    with np.errstate(all="ignore"):
        n_old = np.linalg.norm(old, axis=-1)
        n_new = np.linalg.norm(new, axis=-1)
        if not (np.isfinite(n_old).all() and np.isfinite(n_new).all()):
            return None
        if (n_old == 0).any() or (n_new == 0).any():
            return None
        d = np.linalg.norm(old - new, axis=-1) / np.maximum(n_old, n_new)
    return float(d.max())
