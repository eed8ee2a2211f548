"""Which files ``repair`` regenerates, and what each must look like afterwards.

The targets are the files an audit judged ``corrupt`` (``suspect`` too with
``--include-suspect``): from an audit run here, or from an earlier audit's output
(``--from-audit``: its ``--jsonl`` records, or a ``--list`` file of paths). Each
target carries its own input: the file's ``token_ids`` (a file whose hidden states are
wrong still holds the right token ids: the connector writes the prompt's ids as
given). What the new file must keep is read from the old header too: the tensor names,
the ``hidden_states`` dtype and ``[n_aux, hidden]``, so the training side sees no
difference but correct data. Only numpy and the audit's own header parser are used.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass

from ..audit import format as fmt
from ..audit.reports import CORRUPT, SUSPECT


@dataclass
class Target:
    """One file to regenerate. ``problem`` says why it cannot be (then it is skipped)."""

    path: str
    token_ids: list[int]
    dtype: str | None = None  # hidden_states dtype in the old header, if readable
    n_aux: int | None = None
    hidden: int | None = None
    aux_layers: tuple[int, ...] | None = None  # from provenance metadata, if stamped
    problem: str | None = None

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


def read_target(path: str) -> Target:
    """The old file's token ids and layout; never raises (a problem is recorded)."""
    t = Target(path=path, token_ids=[])
    try:
        size, header, data_start, tensors, layout = fmt.read_layout(path)
    except fmt.BadFile as exc:
        t.problem = f"token ids unreadable: {exc.detail}"
        return t
    except OSError as exc:
        t.problem = f"token ids unreadable: {exc.strerror or exc}"
        return t
    meta = header.get("__metadata__")
    if isinstance(meta, dict) and meta.get("vllm_hsfix.aux_layers"):
        with contextlib.suppress(ValueError):
            t.aux_layers = tuple(int(a) for a in str(meta["vllm_hsfix.aux_layers"]).split(","))
    hs = tensors.get(fmt.HIDDEN_KEY)
    if isinstance(hs, dict) and len(hs.get("shape", [])) == 3:
        t.dtype = hs["dtype"]
        t.n_aux, t.hidden = int(hs["shape"][1]), int(hs["shape"][2])
    ti = tensors.get(fmt.TOKEN_KEY)
    if ti is None or ti["dtype"] != "I64" or len(ti["shape"]) != 1 or not ti["shape"][0]:
        t.problem = "token ids unreadable: no 1-D I64 token_ids tensor"
        return t
    start = data_start + ti["data_offsets"][0]
    if layout is not None and layout.code == "truncated" and start + 8 * ti["shape"][0] > size:
        t.problem = "token ids unreadable: the file ends inside them"
        return t
    t.token_ids = fmt.read_token_ids(path, start, ti["shape"][0]).tolist()
    return t


def from_audit_output(path: str, include_suspect: bool) -> list[str]:
    """The target paths in an earlier audit's ``--jsonl`` (last verdict per path) or
    ``--list`` output (one path per line: every path listed is a target)."""
    with open(path, encoding="utf-8") as f:
        lines = [ln.strip() for ln in f if ln.strip()]
    if lines and lines[0].startswith("{"):
        last: dict[str, str] = {}
        for ln in lines:
            rec = json.loads(ln)
            if rec.get("type") in ("file", "update"):
                last[rec["path"]] = rec["verdict"]
        wanted = {CORRUPT, SUSPECT} if include_suspect else {CORRUPT}
        return [p for p, v in last.items() if v in wanted]
    return lines


def shard(paths: list[str], spec: str | None) -> list[str]:
    """``K/N``: every N-th target from the K-th (0-based) of the sorted list, so N
    machines given the same input split it without talking to each other."""
    if not spec:
        return paths
    k, n = (int(x) for x in spec.split("/"))
    if n < 1 or not 0 <= k < n:
        raise ValueError(f"--shard {spec}: expected K/N with 0 <= K < N")
    return [p for i, p in enumerate(sorted(paths)) if i % n == k]
