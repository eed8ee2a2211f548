"""``vllm-hsfix audit PATH...``: find hidden-states files that a broken vLLM wrote.

vLLM 0.17.0-0.24.x (see README) can save ``extract_hidden_states`` files whose rows are
all zero or copied from other memory: the draft model trains "fine" on them and then
accepts ~0% of tokens. Patching vLLM stops new damage; this auditor finds the damage
already on disk, so only the bad files are regenerated.

Each file is a ``.safetensors`` file written by ``ExampleHiddenStatesConnector`` with
``hidden_states`` ``[tokens, n_aux, hidden]`` (BF16/F16/F32/F64) and ``token_ids``
``[tokens]`` (I64). A "row" is one ``(token, aux layer)`` vector of ``hidden`` values.

Verdicts:

* ``corrupt``: unusable as training data: unreadable, truncated or not safetensors,
  missing keys or wrong dtypes/shapes, empty tensors, ``token_ids`` count not matching,
  any all-zero row, any NaN/Inf.
* ``suspect``: readable but probably damaged: identical rows at different token ids in
  the same aux layer, rows with a norm under 1e-3 x their layer's median, a per-layer
  median row norm far off the rest of the dataset (robust z-score over files), or
  ``[n_aux, hidden]`` differing from the dataset majority, or unexpected extra tensors.
* ``ok``: none of the above.

Exit codes of ``vllm-hsfix audit``: 0 no corrupt file (suspect files are listed, and are
in the ``--json`` ``regenerate`` list, but do not fail the run: their checks are
heuristics, and a training job should not stop on a heuristic); 1 at least one corrupt
file; 2 usage error (a path that does not exist, ``--workers`` < 1, nothing to audit,
the ``--csv`` file cannot be written).

Only numpy and the standard library are used (never vllm, torch or safetensors: the
auditor must run on a bare data box), and numpy is imported lazily so that registering
the subcommand keeps ``vllm-hsfix status`` as cheap as before.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import json
import math
import os
import struct
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, TYPE_CHECKING, Any

from . import audit_prefix
from .audit_prefix import PrefixData

if TYPE_CHECKING:
    from numpy.typing import NDArray

__all__ = [
    "AuditReport",
    "FileReport",
    "LayerStats",
    "Problem",
    "add_parser",
    "audit_file",
    "audit_paths",
    "expand_paths",
    "main",
    "run",
]

CORRUPT = "corrupt"
SUSPECT = "suspect"
OK = "ok"

HIDDEN_KEY = "hidden_states"
TOKEN_KEY = "token_ids"
SUFFIX = ".safetensors"
LOCK_SUFFIX = ".lock"

# Bytes of the file mapped at once. Each window is unmapped before the next one, so the
# resident set stays near this size whatever the file size (a single mapping of the
# whole tensor would count every page read so far in the RSS until the end).
CHUNK_BYTES = 32 * 1024 * 1024
# float32 working block: conversion and the row sums stay in the CPU caches.
BLOCK_BYTES = 1024 * 1024
# safetensors itself refuses headers over 100 MB; larger means "not safetensors".
MAX_HEADER_BYTES = 100_000_000
# A row whose norm is under this fraction of its layer's median is "near zero".
NEAR_ZERO_FRACTION = 1e-3
# Dataset pass: flag a file whose per-layer median row norm is more than OUTLIER_MADS
# scaled MADs (1.4826 x MAD estimates one standard deviation for normal data) away from
# the dataset median of that layer. REL_FLOOR keeps a very uniform dataset (MAD ~ 0) from
# flagging files that differ by a few percent: with it, a file is an outlier only when
# its median norm is more than 6 x 5% = 30% off. Measured on real vLLM output (chat-like
# prompts sharing templates: norms very uniform), a floor of 1% flagged a correct
# 14-token file whose median norm was 0.935x the dataset's.
OUTLIER_MADS = 6.0
MAD_SCALE = 1.4826
REL_FLOOR = 0.05
MIN_FILES_FOR_OUTLIERS = 3
# Row samples that make up the cheap per-row key; equal keys are then confirmed with a
# blake2b digest of the whole row, so the key only has to be fast, not strong.
KEY_SAMPLES = 16

ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
# How each accepted hidden_states dtype is mapped (raw) and seen as integers (keys).
HIDDEN_RAW = {"BF16": "<u2", "F16": "<f2", "F32": "<f4", "F64": "<f8"}
HIDDEN_INT = {"BF16": "<u2", "F16": "<u2", "F32": "<u4", "F64": "<u8"}
TOKEN_DTYPES = ("I64",)

ProgressFn = Callable[[int, int], None]


@dataclass
class Problem:
    """One finding. ``code`` is stable for scripts; ``detail`` is for people."""

    code: str
    severity: str
    detail: str


@dataclass
class LayerStats:
    """Row-norm statistics of one aux layer over its finite, non-zero rows.

    The dataset pass compares ``median_norm`` across files (a median, not the mean,
    because attention-sink tokens legitimately have norms 100x the others, and a short
    prompt's mean would then look like an outlier).
    """

    aux: int
    count: int
    mean_norm: float | None
    std_norm: float | None
    median_norm: float | None
    min_norm: float | None
    max_norm: float | None
    zero_rows: int = 0
    nonfinite_rows: int = 0
    near_zero_rows: int = 0
    duplicate_rows: int = 0


@dataclass
class FileReport:
    """Everything the auditor learned about one file; picklable for the worker pool."""

    path: str
    bytes: int = 0
    verdict: str = OK
    dtype: str | None = None
    n_tokens: int | None = None
    n_aux: int | None = None
    hidden: int | None = None
    n_token_ids: int | None = None
    token_mismatch: bool = False
    zero_rows: int = 0
    nan_count: int = 0
    inf_count: int = 0
    duplicate_rows: int = 0
    near_zero_rows: int = 0
    layers: list[LayerStats] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    provenance: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    # First token ids and row sketches for the cross-file prefix check (dropped after it).
    prefix: PrefixData | None = field(default=None, repr=False)

    def add(self, code: str, severity: str, detail: str) -> None:
        """Record a finding and keep the verdict the worst severity seen."""
        self.problems.append(Problem(code, severity, detail))
        if severity == CORRUPT or (severity == SUSPECT and self.verdict == OK):
            self.verdict = severity

    def codes(self) -> list[str]:
        """The problem codes, for tests and filters."""
        return [p.code for p in self.problems]

    def reason(self) -> str:
        """One line: every finding's detail."""
        return "; ".join(p.detail for p in self.problems)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (no NaN: missing statistics are ``None``)."""
        out = asdict(self)
        out.pop("prefix", None)
        return out


@dataclass
class AuditReport:
    """A whole run: per-file reports (input order), dataset references and totals."""

    files: list[FileReport]
    wall_s: float
    workers: int
    dataset: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def count(self, verdict: str) -> int:
        """Number of files with ``verdict``."""
        return sum(f.verdict == verdict for f in self.files)

    @property
    def regenerate(self) -> list[str]:
        """Files to produce again with a fixed vLLM: the corrupt and the suspect ones."""
        return [f.path for f in self.files if f.verdict != OK]

    def totals(self) -> dict[str, Any]:
        """Counts and throughput (GB = 1e9 bytes)."""
        wall = max(self.wall_s, 1e-9)
        return {
            "files": len(self.files),
            "bytes": self.total_bytes,
            OK: self.count(OK),
            SUSPECT: self.count(SUSPECT),
            CORRUPT: self.count(CORRUPT),
            "wall_s": round(self.wall_s, 4),
            "gb_per_s": round(self.total_bytes / 1e9 / wall, 4),
            "files_per_s": round(len(self.files) / wall, 2),
            "workers": self.workers,
        }

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` document."""
        return {
            "schema": 1,
            "totals": self.totals(),
            "regenerate": self.regenerate,
            "dataset": self.dataset,
            "files": [f.to_dict() for f in self.files],
        }


class _Bad(Exception):
    """A finding that ends the audit of a file (nothing further can be read)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


# --------------------------------------------------------------------------- header


def _read_header(f: IO[bytes], size: int) -> tuple[dict[str, Any], int]:
    """Parse the safetensors header by hand: the auditor must not need the library, and
    must say *why* a file is unreadable instead of raising on it."""
    if size < 8:
        raise _Bad("not_safetensors", f"not a safetensors file: only {size} bytes")
    (n,) = struct.unpack("<Q", f.read(8))
    if n == 0 or n > MAX_HEADER_BYTES:
        raise _Bad("not_safetensors", f"not a safetensors file: header length {n}")
    raw = f.read(n)
    if len(raw) < n:
        if raw[:1] == b"{":
            raise _Bad("truncated", f"truncated inside the header ({size} of {8 + n}+ bytes)")
        raise _Bad("not_safetensors", f"not a safetensors file: header length {n} > file")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _Bad("not_safetensors", "not a safetensors file: header is not JSON") from None
    if not isinstance(header, dict):
        raise _Bad("not_safetensors", "not a safetensors file: header is not a JSON object")
    return header, 8 + n


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_layout(header: dict[str, Any], data_len: int) -> tuple[dict[str, Any], Problem | None]:
    """Validate every tensor entry the way safetensors' own loader does (contiguous,
    sized by shape x dtype, ending exactly at the end of the file). Returns the entries
    and, for a file that is too short or too long, that finding: the caller still reports
    the shapes the header promises before giving up on the data."""
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    spans = []
    for name, t in tensors.items():
        ok = (
            isinstance(t, dict)
            and isinstance(t.get("dtype"), str)
            and isinstance(t.get("shape"), list)
            and all(_is_int(d) for d in t["shape"])
            and isinstance(t.get("data_offsets"), list)
            and len(t["data_offsets"]) == 2
            and all(_is_int(o) for o in t["data_offsets"])
            and t["data_offsets"][0] <= t["data_offsets"][1]
        )
        if not ok:
            raise _Bad("bad_header", f"tensor {name!r}: malformed header entry {t!r:.120}")
        if t["dtype"] not in ITEMSIZE:
            raise _Bad("bad_header", f"tensor {name!r}: unknown dtype {t['dtype']!r}")
        begin, end = t["data_offsets"]
        need = math.prod(t["shape"]) * ITEMSIZE[t["dtype"]]
        if end - begin != need:
            raise _Bad(
                "bad_header",
                f"tensor {name!r}: shape {t['shape']} {t['dtype']} needs {need} bytes, "
                f"offsets give {end - begin}",
            )
        spans.append((begin, end, name))
    expected = 0
    for begin, end, name in sorted(spans):
        if begin != expected:
            raise _Bad("bad_header", f"tensor {name!r}: data at {begin}, expected {expected}")
        expected = end
    if expected > data_len:
        missing = expected - data_len
        detail = f"truncated: tensors need {expected} data bytes, file has {data_len}"
        return tensors, Problem("truncated", CORRUPT, f"{detail} ({missing} missing)")
    if expected < data_len:
        extra = data_len - expected
        detail = f"{extra} bytes after the last tensor (safetensors refuses the file)"
        return tensors, Problem("trailing_bytes", CORRUPT, detail)
    return tensors, None


# --------------------------------------------------------------------------- rows


def _row_keys(ints: NDArray[Any], cols: NDArray[Any], mult: NDArray[Any]) -> NDArray[Any]:
    """Cheap 64-bit key per row from a few sampled elements (wrapping multiply-add).

    Identical rows always get identical keys; different rows almost never do, and when
    they do the full-row digest that follows tells them apart."""
    import numpy as np

    sample = ints[:, cols].astype(np.uint64)
    sample *= mult
    return sample.sum(axis=1, dtype=np.uint64)


class _Scan:
    """Per-file row arrays: O(rows) small numbers, never O(file bytes), plus a float32
    copy of the first ``head_rows`` rows, taken as they stream by (the prefix check's
    input; no second read of the file)."""

    def __init__(self, n_rows: int, head_rows: int = 0, hidden: int = 0) -> None:
        import numpy as np

        self.head = np.zeros((min(head_rows, n_rows), hidden), dtype=np.float32)
        self.sumsq = np.zeros(n_rows, dtype=np.float64)
        self.keys = np.zeros(n_rows, dtype=np.uint64)
        self.zero = np.zeros(n_rows, dtype=bool)
        self.bad = np.zeros(n_rows, dtype=bool)
        self.nan = 0
        self.inf = 0


def _block_rows(
    scan: _Scan,
    row0: int,
    work: NDArray[Any],
    ints: NDArray[Any],
    cols: NDArray[Any],
    mult: NDArray[Any],
) -> None:
    """Squared norms, keys, zero and non-finite rows of one block of float rows.

    The fast path is one ``einsum`` per block; only blocks with a zero or non-finite sum
    look at values again (to tell an all-zero row from underflow, and NaN/Inf from
    overflow of large finite values)."""
    import numpy as np

    n = work.shape[0]
    s = np.einsum("ij,ij->i", work, work)
    out = scan.sumsq[row0 : row0 + n]
    out[:] = s
    scan.keys[row0 : row0 + n] = _row_keys(ints, cols, mult)
    fin = np.isfinite(s)
    if not fin.all():
        idx = np.flatnonzero(~fin)
        sub = work[idx]
        nan = np.isnan(sub)
        inf = np.isinf(sub)
        scan.nan += int(nan.sum())
        scan.inf += int(inf.sum())
        rowbad = (nan | inf).any(axis=1)
        scan.bad[row0 + idx[rowbad]] = True
        out[idx[rowbad]] = np.nan
        big = ~rowbad  # finite values whose squares overflowed the working precision
        if big.any():
            out[idx[big]] = np.square(sub[big].astype(np.float64)).sum(axis=1)
    zc = s == 0
    if zc.any():
        idx = np.flatnonzero(zc)
        sub = work[idx]
        allzero = ~(sub != 0).any(axis=1)
        scan.zero[row0 + idx[allzero]] = True
        tiny = ~allzero  # non-zero values whose squares underflowed
        if tiny.any():
            out[idx[tiny]] = np.square(sub[tiny].astype(np.float64)).sum(axis=1)


def _scan_window(
    scan: _Scan,
    path: str,
    offset: int,
    dtype: str,
    row0: int,
    n_rows: int,
    hidden: int,
    cols: NDArray[Any],
    mult: NDArray[Any],
) -> None:
    """Map ``n_rows`` rows at ``offset``, scan them block by block, unmap on return."""
    import numpy as np

    mm = np.memmap(path, dtype=HIDDEN_RAW[dtype], mode="r", offset=offset, shape=(n_rows, hidden))
    # Plain ndarray views of the mapping: slicing np.memmap itself costs a Python-level
    # __getitem__/__array_finalize__ per slice, a fifth of the scan on small hidden sizes.
    raw = np.asarray(mm)
    ints = raw.view(HIDDEN_INT[dtype])
    if dtype == "F64":
        block = max(1, BLOCK_BYTES // (hidden * 8))
    else:
        block = max(1, BLOCK_BYTES // (hidden * 4))
    buf = None
    if dtype in ("BF16", "F16"):
        buf = np.empty((block, hidden), dtype=np.uint32 if dtype == "BF16" else np.float32)
    for b in range(0, n_rows, block):
        e = min(n_rows, b + block)
        if buf is not None and dtype == "BF16":
            # bf16 is the top half of a float32: widen, shift left 16, reinterpret.
            w = buf[: e - b]
            np.left_shift(ints[b:e], 16, out=w, dtype=np.uint32)
            work = w.view(np.float32)
        elif buf is not None:  # F16
            work = buf[: e - b]
            work[...] = raw[b:e]
        else:
            work = raw[b:e]
        if row0 + b < len(scan.head):
            take = min(len(scan.head), row0 + e) - (row0 + b)
            with np.errstate(all="ignore"):  # F64 beyond float32 becomes inf: not sound
                scan.head[row0 + b : row0 + b + take] = work[:take]
        _block_rows(scan, row0 + b, work, ints[b:e], cols, mult)
    del ints, raw, mm  # the last references: the window is unmapped here


def _read_token_ids(path: str, offset: int, n: int) -> NDArray[Any]:
    import numpy as np

    return np.fromfile(path, dtype="<i8", count=n, offset=offset)


def _duplicates(
    rep: FileReport,
    scan: _Scan,
    path: str,
    offset: int,
    shape: tuple[int, int, int],
    row_bytes: int,
    token_ids: NDArray[Any],
) -> list[int]:
    """Count rows identical to a row of a *different token id* in the same aux layer.

    Same-token repeats are left alone: a layer close to the embeddings can legitimately
    give one token id the same vector at every position. Candidates (equal cheap keys)
    are re-read with ``pread`` and confirmed by a blake2b digest of the whole row."""
    import numpy as np

    n_tokens, n_aux, _ = shape
    per_layer = [0] * n_aux
    examples: list[str] = []
    keys = scan.keys.reshape(n_tokens, n_aux)
    skip = (scan.zero | scan.bad).reshape(n_tokens, n_aux)
    fd = os.open(path, os.O_RDONLY)
    try:
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
                digest = hashlib.blake2b(data, digest_size=16).digest()
                groups.setdefault(digest, []).append(t)
            for ts in groups.values():
                if len(ts) > 1 and len({int(token_ids[t]) for t in ts}) > 1:
                    per_layer[a] += len(ts) - 1
                    if len(examples) < 3:
                        examples.append(f"aux {a}: token positions {sorted(ts)[:4]}")
    finally:
        os.close(fd)
    total = sum(per_layer)
    if total:
        rep.add(
            "duplicate_rows",
            SUSPECT,
            f"{total} rows repeat a row of a different token in the same aux layer "
            f"(e.g. {'; '.join(examples)})",
        )
    return per_layer


def _finite(x: Any) -> float | None:
    """A statistic as a JSON-safe float: ``None`` where F64 norms overflowed."""
    v = float(x)
    return v if math.isfinite(v) else None


def _scan_hidden(
    rep: FileReport,
    path: str,
    offset: int,
    dtype: str,
    shape: tuple[int, int, int],
    token_ids: NDArray[Any] | None,
) -> None:
    """Stream ``hidden_states`` window by window and fill the row findings of ``rep``."""
    import numpy as np

    n_tokens, n_aux, hidden = shape
    n_rows = n_tokens * n_aux
    row_bytes = hidden * ITEMSIZE[dtype]
    with_prefix = token_ids is not None and len(token_ids) == n_tokens
    scan = _Scan(n_rows, audit_prefix.PREFIX_ROWS * n_aux if with_prefix else 0, hidden)
    cols = np.unique(np.linspace(0, hidden - 1, min(hidden, KEY_SAMPLES)).round().astype(np.intp))
    mult = np.random.default_rng(0x5EED).integers(1, 2**63, size=len(cols), dtype=np.uint64)
    mult |= np.uint64(1)
    # Whole tokens per window, so a window never splits one token's aux rows.
    tokens_per_window = max(1, CHUNK_BYTES // (n_aux * row_bytes))
    for t0 in range(0, n_tokens, tokens_per_window):
        t1 = min(n_tokens, t0 + tokens_per_window)
        _scan_window(
            scan,
            path,
            offset + t0 * n_aux * row_bytes,
            dtype,
            t0 * n_aux,
            (t1 - t0) * n_aux,
            hidden,
            cols,
            mult,
        )

    rep.nan_count, rep.inf_count = scan.nan, scan.inf
    zero = scan.zero.reshape(n_tokens, n_aux)
    bad = scan.bad.reshape(n_tokens, n_aux)
    norms = np.sqrt(scan.sumsq).reshape(n_tokens, n_aux)
    rep.zero_rows = int(zero.sum())
    if rep.zero_rows:
        first = int(np.flatnonzero(zero.any(axis=1))[0])
        layers = {a: int(zero[:, a].sum()) for a in range(n_aux) if zero[:, a].any()}
        rep.add(
            "zero_rows",
            CORRUPT,
            f"{rep.zero_rows} of {n_rows} rows are all zero (per aux layer {layers}; "
            f"first at token position {first})",
        )
    if scan.nan or scan.inf:
        rep.add(
            "nonfinite",
            CORRUPT,
            f"{scan.nan} NaN and {scan.inf} Inf values in {int(bad.sum())} rows",
        )
    ids = token_ids if token_ids is not None else np.arange(n_tokens)
    dups = _duplicates(rep, scan, path, offset, shape, row_bytes, ids)

    for a in range(n_aux):
        v = norms[:, a][~(zero[:, a] | bad[:, a])]
        st = LayerStats(
            aux=a,
            count=len(v),
            mean_norm=None,
            std_norm=None,
            median_norm=None,
            min_norm=None,
            max_norm=None,
            zero_rows=int(zero[:, a].sum()),
            nonfinite_rows=int(bad[:, a].sum()),
            duplicate_rows=dups[a],
        )
        if len(v):
            med = float(np.median(v))
            st.mean_norm, st.std_norm = _finite(v.mean()), _finite(v.std())
            st.median_norm, st.min_norm, st.max_norm = (
                _finite(med),
                _finite(v.min()),
                _finite(v.max()),
            )
            st.near_zero_rows = int((v < NEAR_ZERO_FRACTION * med).sum())
        rep.layers.append(st)
    if with_prefix and n_tokens:
        rep.prefix = _prefix_data(scan.head, shape, token_ids, zero, bad)  # type: ignore[arg-type]
    rep.duplicate_rows = sum(dups)
    rep.near_zero_rows = sum(st.near_zero_rows for st in rep.layers)
    if rep.near_zero_rows:
        layers = {st.aux: st.near_zero_rows for st in rep.layers if st.near_zero_rows}
        rep.add(
            "near_zero_rows",
            SUSPECT,
            f"{rep.near_zero_rows} rows have a norm under {NEAR_ZERO_FRACTION:g} x their "
            f"layer's median (per aux layer {layers})",
        )


def _prefix_data(
    head: NDArray[Any],
    shape: tuple[int, int, int],
    token_ids: NDArray[Any],
    zero: NDArray[Any],
    bad: NDArray[Any],
) -> PrefixData:
    """The first rows' sketches and token ids, for the cross-file prefix check; ``head``
    holds those rows as the scan saw them ([tokens x n_aux, hidden], float32)."""
    import numpy as np

    n_tokens, n_aux, hidden = shape
    k = min(n_tokens, audit_prefix.PREFIX_ROWS)
    rows = head.reshape(k, n_aux, hidden)
    sound = ~(zero[:k] | bad[:k])
    rows = np.where(sound[..., None], rows, 0.0).astype(np.float32)
    with np.errstate(all="ignore"):  # huge rows overflow: their norm is inf, not sound
        sketch = audit_prefix.sketch_rows(rows)
        norms = np.linalg.norm(sketch, axis=-1)
    sound &= np.isfinite(norms)
    # Unit vectors in float16 (half the transfer from the workers) and the norms in
    # float32: activations of large models overflow float16 themselves.
    with np.errstate(all="ignore"):
        unit = sketch / np.where(norms > 0, norms, 1.0)[..., None]
    return PrefixData(
        token_ids=tuple(int(t) for t in token_ids[:k]),
        sketches=np.nan_to_num(unit).astype(np.float16),
        norms=np.where(sound, norms, 0.0).astype(np.float32),
        sound=sound,
        shape_key=(n_aux, hidden),
    )


def _check_keys(rep: FileReport, tensors: dict[str, Any]) -> tuple[bool, bool]:
    """Keys, dtypes and shapes against what the connector writes. Fills the shape
    fields of ``rep`` and says whether ``hidden_states`` and ``token_ids`` can be read."""
    hs, ti = tensors.get(HIDDEN_KEY), tensors.get(TOKEN_KEY)
    missing = [k for k in (HIDDEN_KEY, TOKEN_KEY) if k not in tensors]
    if missing:
        rep.add("missing_key", CORRUPT, f"missing tensor(s) {missing}; has {sorted(tensors)}")
    extra = sorted(set(tensors) - {HIDDEN_KEY, TOKEN_KEY})
    if extra and not missing:
        rep.add("extra_keys", SUSPECT, f"unexpected tensor(s) {extra} (the connector writes 2)")

    hs_ok = hs is not None
    if hs is not None:
        rep.dtype = hs["dtype"]
        if hs["dtype"] not in HIDDEN_RAW:
            rep.add(
                "wrong_dtype",
                CORRUPT,
                f"{HIDDEN_KEY} dtype {hs['dtype']}, expected one of {sorted(HIDDEN_RAW)}",
            )
            hs_ok = False
        if len(hs["shape"]) != 3:
            rep.add("bad_shape", CORRUPT, f"{HIDDEN_KEY} has shape {hs['shape']}, expected 3-D")
            hs_ok = False
        else:
            rep.n_tokens, rep.n_aux, rep.hidden = hs["shape"]
            if 0 in hs["shape"]:
                rep.add("empty", CORRUPT, f"{HIDDEN_KEY} is empty: shape {hs['shape']}")
                hs_ok = False

    ti_ok = ti is not None
    if ti is not None:
        if ti["dtype"] not in TOKEN_DTYPES:
            rep.add("wrong_dtype", CORRUPT, f"{TOKEN_KEY} dtype {ti['dtype']}, expected I64")
            ti_ok = False
        if len(ti["shape"]) != 1:
            rep.add("bad_shape", CORRUPT, f"{TOKEN_KEY} has shape {ti['shape']}, expected 1-D")
            ti_ok = False
        else:
            rep.n_token_ids = ti["shape"][0]
            if rep.n_token_ids == 0:
                ti_ok = False
                if rep.n_tokens != 0:  # an empty hidden_states already said "empty"
                    rep.add("empty", CORRUPT, f"{TOKEN_KEY} is empty")
        known = rep.n_tokens is not None and rep.n_token_ids is not None
        if known and rep.n_token_ids != rep.n_tokens:
            rep.token_mismatch = True
            rep.add(
                "token_mismatch",
                CORRUPT,
                f"{rep.n_token_ids} token_ids for {rep.n_tokens} hidden-state tokens",
            )
            ti_ok = False
    return hs_ok, ti_ok


def _audit_into(rep: FileReport, path: str) -> None:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        rep.bytes = size
        header, data_start = _read_header(f, size)
        meta = header.get("__metadata__")
        if isinstance(meta, dict):
            rep.provenance = {
                k: str(v) for k, v in meta.items() if str(k).startswith("vllm_hsfix.")
            }
    tensors, layout = _check_layout(header, size - data_start)
    if layout is not None:
        if layout.code == "truncated" and os.path.exists(path + LOCK_SUFFIX):
            layout.detail += " (a .lock file sits beside it: the writer may still be running)"
        rep.add(layout.code, layout.severity, layout.detail)
    hs_ok, ti_ok = _check_keys(rep, tensors)
    if layout is not None and layout.code == "truncated":
        return  # the data the header points at is not all there: reading it hits EOF
    token_ids = None
    if ti_ok:
        ti = tensors[TOKEN_KEY]
        token_ids = _read_token_ids(path, data_start + ti["data_offsets"][0], ti["shape"][0])
    if hs_ok:
        hs = tensors[HIDDEN_KEY]
        shape = (rep.n_tokens or 0, rep.n_aux or 0, rep.hidden or 0)
        _scan_hidden(rep, path, data_start + hs["data_offsets"][0], hs["dtype"], shape, token_ids)


def audit_file(path: str | os.PathLike[str]) -> FileReport:
    """Audit one file. Never raises: whatever goes wrong becomes a ``corrupt`` finding,
    because one bad file must not hide the verdicts of the thousands after it."""
    t0 = time.perf_counter()
    p = os.fspath(path)
    rep = FileReport(path=p)
    try:
        _audit_into(rep, p)
    except _Bad as exc:
        detail = exc.detail
        if exc.code == "truncated" and os.path.exists(p + LOCK_SUFFIX):
            detail += " (a .lock file sits beside it: the writer may still be running)"
        rep.add(exc.code, CORRUPT, detail)
    except OSError as exc:
        rep.add("unreadable", CORRUPT, f"cannot read: {exc.strerror or exc}")
    except Exception as exc:  # MemoryError, numpy errors on hostile headers, ...
        rep.add("unreadable", CORRUPT, f"audit failed: {exc!r}")
    rep.seconds = time.perf_counter() - t0
    return rep


# --------------------------------------------------------------------------- dataset


def expand_paths(paths: Iterable[str | os.PathLike[str]]) -> list[str]:
    """Directories give their ``*.safetensors`` files, recursively and sorted; a file
    named explicitly is audited whatever its name (a shell glob may hand us a stray
    file and the user should hear about it), except ``.lock`` companions. Duplicates
    are dropped. Raises ``FileNotFoundError`` for a path that does not exist."""
    out: list[str] = []
    seen: set[str] = set()

    def keep(p: str) -> None:
        real = os.path.realpath(p)
        if real not in seen:
            seen.add(real)
            out.append(p)

    for raw in paths:
        p = os.fspath(raw)
        if os.path.isdir(p):
            found = []
            for root, dirs, names in os.walk(p):
                dirs.sort()
                found += [os.path.join(root, n) for n in names if n.endswith(SUFFIX)]
            for q in sorted(found):
                keep(q)
        elif os.path.exists(p):
            if not p.endswith(LOCK_SUFFIX):
                keep(p)
        else:
            raise FileNotFoundError(f"no such file or directory: {p}")
    return out


def _dataset_pass(files: list[FileReport]) -> dict[str, Any]:
    """Cross-file checks, which no single file can answer: the ``[n_aux, hidden]``
    majority, and per aux layer, files whose median row norm is a robust outlier."""
    import numpy as np

    info: dict[str, Any] = {"majority_shape": None, "norm_reference": []}
    shapes = Counter((f.n_aux, f.hidden) for f in files if f.n_aux and f.hidden)
    n_shaped = sum(shapes.values())
    if shapes and n_shaped >= MIN_FILES_FOR_OUTLIERS:
        (shape, n), *_ = shapes.most_common(1)
        if n * 2 > n_shaped:
            info["majority_shape"] = list(shape)
            for f in files:
                if f.n_aux and f.hidden and (f.n_aux, f.hidden) != shape:
                    f.add(
                        "shape_outlier",
                        SUSPECT,
                        f"[n_aux, hidden] = [{f.n_aux}, {f.hidden}] but {n} of {n_shaped} "
                        f"files have {list(shape)}",
                    )
    for n_aux, hidden in sorted(shapes):
        group = [f for f in files if (f.n_aux, f.hidden) == (n_aux, hidden)]
        for a in range(n_aux):
            members = [
                (f, f.layers[a].median_norm)
                for f in group
                if len(f.layers) > a and f.layers[a].median_norm is not None
            ]
            if len(members) < MIN_FILES_FOR_OUTLIERS:
                continue
            vals = np.array([v for _, v in members], dtype=np.float64)
            med = float(np.median(vals))
            mad = float(np.median(np.abs(vals - med)))
            scale = max(MAD_SCALE * mad, REL_FLOOR * abs(med))
            ref = {
                "n_aux": n_aux,
                "hidden": hidden,
                "aux": a,
                "files": len(members),
                "median": med,
                "mad": mad,
                "threshold": OUTLIER_MADS * scale,
            }
            info["norm_reference"].append(ref)
            if scale <= 0:
                continue
            for f, v in members:
                z = abs(v - med) / scale
                if z > OUTLIER_MADS:
                    ratio = v / med if med else math.inf
                    f.add(
                        "norm_outlier",
                        SUSPECT,
                        f"aux layer {a}: median row norm {v:.4g} is {ratio:.3g}x the dataset "
                        f"median {med:.4g} (robust z {z:.1f} > {OUTLIER_MADS:g})",
                    )
    return info


def _crashed(path: str, exc: BaseException) -> FileReport:
    rep = FileReport(path=path)
    with contextlib.suppress(OSError):
        rep.bytes = os.path.getsize(path)
    rep.add("unreadable", CORRUPT, f"audit worker died ({exc!r}); file changed while read?")
    return rep


def _run_pool(files: list[str], workers: int, progress: ProgressFn | None) -> list[FileReport]:
    """Audit ``files`` in worker processes (numpy releases little of the GIL for this
    work, so threads would not scale). A worker killed mid-file (SIGBUS when a file
    shrinks under its mapping, OOM) breaks the pool: the files it took down are retried
    one per fresh process, so the crash is pinned on the file that causes it."""
    import multiprocessing
    import threading
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # fork starts workers in milliseconds and needs no importable __main__ (stdin scripts,
    # notebooks), but forking a threaded process can deadlock the child: there, use
    # forkserver (spawn where it is missing).
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        method = "fork"
    else:
        method = "forkserver" if "forkserver" in methods else "spawn"
    ctx = multiprocessing.get_context(method)
    import numpy  # noqa: F401  (loaded once here, so forked workers inherit it)

    results: dict[int, FileReport] = {}
    failed: list[int] = []
    done = 0
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = {pool.submit(audit_file, p): i for i, p in enumerate(files)}
        for fut in as_completed(futures):
            i = futures[fut]
            try:
                results[i] = fut.result()
            except Exception:
                failed.append(i)
                continue
            done += 1
            if progress:
                progress(done, len(files))
    # A worker that dies breaks the whole pool, so every file still in flight lands
    # here: retry each alone, and only then decide which ones kill a worker.
    crashed: dict[int, BaseException] = {}
    for i in sorted(failed):
        try:
            with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
                results[i] = pool.submit(audit_file, files[i]).result()
        except Exception as exc:
            crashed[i] = exc
        done += 1
        if progress:
            progress(done, len(files))
    if crashed and not results:
        # Nothing has ever come back: the workers cannot run here at all, which says
        # nothing about the files. Do not call them corrupt.
        exc = next(iter(crashed.values()))
        raise RuntimeError(f"audit worker processes cannot run: {exc!r}") from exc
    for i, exc in crashed.items():
        results[i] = _crashed(files[i], exc)
    return [results[i] for i in range(len(files))]


def default_workers() -> int:
    """min(4, CPUs): past a few processes the scan is bound by the disk, not the CPU."""
    return max(1, min(4, os.cpu_count() or 1))


def audit_paths(
    paths: Iterable[str | os.PathLike[str]],
    workers: int | None = None,
    progress: ProgressFn | None = None,
) -> AuditReport:
    """Audit files and directories: the per-file pass in parallel, then the dataset pass.

    ``progress(done, total)`` is called after each file. Raises ``FileNotFoundError`` for
    a missing path and ``ValueError`` for ``workers`` < 1."""
    t0 = time.perf_counter()
    files = expand_paths(paths)
    n = default_workers() if workers is None else workers
    if n < 1:
        raise ValueError(f"workers must be >= 1, got {n}")
    n = max(1, min(n, len(files)))
    reports = _run_pool(files, n, progress) if files else []
    dataset = _dataset_pass(reports) if reports else {}
    if reports:
        dataset["prefix"] = _prefix_pass(reports)
    return AuditReport(files=reports, wall_s=time.perf_counter() - t0, workers=n, dataset=dataset)


def _prefix_pass(reports: list[FileReport]) -> dict[str, Any]:
    """Cross-file shared-prefix consistency (``audit_prefix``); findings are corrupt."""
    result = audit_prefix.check([r.prefix for r in reports])
    for index, finding in result.findings.items():
        reports[index].add("prefix_mismatch", CORRUPT, audit_prefix.describe(finding))
    for r in reports:
        r.prefix = None
    return result.summary(len(reports))


# --------------------------------------------------------------------------- output


class ProgressBar:
    """``\\r[#####     ] 123/456 files`` on a stream, redrawn at most 10 times a second."""

    def __init__(self, stream: IO[str] | None = None, width: int = 30) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self._last = 0.0
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        filled = self.width * done // max(total, 1)
        bar = "#" * filled + " " * (self.width - filled)
        self.stream.write(f"\r[{bar}] {done}/{total} files")
        self._drawn = True
        if done >= total:
            self.close()
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line so what follows starts clean."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def format_human(report: AuditReport) -> str:
    """Summary first, then one line per file that is not ok, with its reasons."""
    t = report.totals()
    lines = [
        f"audited {t['files']} files, {t['bytes'] / 1e9:.3f} GB in {t['wall_s']:.2f} s "
        f"({t['gb_per_s']:.3f} GB/s, {t['files_per_s']:.1f} files/s, {t['workers']} workers)",
        f"  ok {t[OK]}   suspect {t[SUSPECT]}   corrupt {t[CORRUPT]}",
    ]
    bad = [f for f in report.files if f.verdict != OK]
    for f in sorted(bad, key=lambda f: (f.verdict != CORRUPT, f.path)):
        lines.append(f"{f.verdict.upper():<8} {f.path}")
        lines += [f"         {p.code}: {p.detail}" for p in f.problems]
    pre = report.dataset.get("prefix")
    if pre:
        lines.append(
            f"  shared prefixes: {pre['files_checked']} of {t['files']} files share a prompt "
            f"prefix with another and were cross-checked on their first {pre['positions']} "
            f"rows; {pre['files_flagged']} disagree ({pre['groups_without_consensus']} groups "
            "without a consensus)"
        )
    stamped = [f for f in report.files if f.provenance]
    if stamped:
        kinds = sorted(
            {
                f"vllm-hsfix {f.provenance.get('vllm_hsfix.version', '?')} on vLLM "
                f"{f.provenance.get('vllm_hsfix.vllm', '?')} "
                f"[{f.provenance.get('vllm_hsfix.patches', '?')}]"
                for f in stamped
            }
        )
        lines.append(
            f"  provenance: {len(stamped)} of {t['files']} files made with " + "; ".join(kinds)
        )
    else:
        lines.append(f"  provenance: none of {t['files']} files carry vllm-hsfix metadata")
    if bad:
        lines.append(f"regenerate: {len(bad)} files (corrupt or suspect; --json lists them)")
    if t[CORRUPT]:
        lines.append("result: CORRUPT files found (exit 1)")
    elif t[SUSPECT]:
        lines.append("result: no corrupt files; suspect files listed above (exit 0)")
    else:
        lines.append("result: all files ok")
    return "\n".join(lines)


CSV_FIELDS = [
    "path",
    "verdict",
    "bytes",
    "dtype",
    "n_tokens",
    "n_aux",
    "hidden",
    "n_token_ids",
    "token_mismatch",
    "zero_rows",
    "nan_count",
    "inf_count",
    "duplicate_rows",
    "near_zero_rows",
    "codes",
    "reason",
    "provenance",
]


def write_csv(report: AuditReport, dest: str | os.PathLike[str] | IO[str]) -> None:
    """One row per file, for spreadsheets and ``pandas.read_csv``."""

    def rows(out: IO[str]) -> None:
        w = csv.DictWriter(out, fieldnames=CSV_FIELDS)
        w.writeheader()
        for f in report.files:
            d = {k: getattr(f, k) for k in CSV_FIELDS if hasattr(f, k)}
            d["codes"] = " ".join(f.codes())
            d["reason"] = f.reason()
            d["provenance"] = " ".join(f"{k}={v}" for k, v in sorted(f.provenance.items()))
            w.writerow(d)

    if isinstance(dest, (str, os.PathLike)):
        with open(dest, "w", newline="", encoding="utf-8") as out:
            rows(out)
    else:
        rows(dest)


# --------------------------------------------------------------------------- CLI


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
    from . import audit_reference

    problem = audit_reference.missing_dependency()
    if problem:
        return problem
    if not os.path.isfile(os.path.join(args.reference, "config.json")):
        return f"vllm-hsfix audit: --reference {args.reference} holds no config.json"
    try:
        aux = [int(a) for a in (args.aux_layers or "").split(",") if a.strip()]
        if not aux:
            return "vllm-hsfix audit: --reference needs --aux-layers (e.g. 1,2,3)"
        audit_reference.sample(["x"], args.sample)
    except ValueError as exc:
        return f"vllm-hsfix audit: {exc}"
    return None


def _reference_pass(report: AuditReport, args: argparse.Namespace) -> None:
    """``--reference``: recompute a sample; mismatching files become corrupt."""
    from . import audit_reference

    err = sys.stderr
    aux = [int(a) for a in args.aux_layers.split(",") if a.strip()]
    readable = [f.path for f in report.files if f.n_tokens]
    if not readable:
        return None
    results, summary = audit_reference.check(
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


if __name__ == "__main__":
    sys.exit(main())
