"""The hidden-states file formats the audit knows (``plain`` and ``fp8`` safetensors),
with the header parsed by hand so that a bad file gets a reason, not an exception."""

from __future__ import annotations

import json
import math
import os
import struct
from typing import IO, TYPE_CHECKING, Any

from .reports import CORRUPT, SUSPECT, UNSUPPORTED, FileReport, Problem

if TYPE_CHECKING:
    from numpy.typing import NDArray

HIDDEN_KEY = "hidden_states"
TOKEN_KEY = "token_ids"
SCALES_KEY = "hidden_states_scales"
SUFFIX = ".safetensors"
LOCK_SUFFIX = ".lock"

# safetensors itself refuses headers over 100 MB; larger means "not safetensors".
MAX_HEADER_BYTES = 100_000_000

ITEMSIZE = {
    **dict.fromkeys(["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3"], 1),
    **dict.fromkeys(["I16", "U16", "F16", "BF16"], 2),
    **dict.fromkeys(["I32", "U32", "F32"], 4),
    **dict.fromkeys(["I64", "U64", "F64"], 8),
}
# How each accepted hidden_states dtype is mapped (raw) and seen as integers (keys).
HIDDEN_RAW = {"BF16": "<u2", "F16": "<f2", "F32": "<f4", "F64": "<f8"}
HIDDEN_INT = {"BF16": "<u2", "F16": "<u2", "F32": "<u4", "F64": "<u8"}
TOKEN_DTYPES = ("I64",)
FP8_DTYPE = "F8_E4M3"
SCALES_DTYPE = "F32"
# The layouts (``FileReport.format``) and who writes them.
PLAIN = "plain"
FP8 = "fp8"
FORMATS = {
    PLAIN: "as vLLM's ExampleHiddenStatesConnector writes them",
    FP8: "as hs-connectors' FP8HiddenStatesConnector writes them (float8_e4m3fn x "
    "per-token scales; checked de-quantized)",
}


class BadFile(Exception):
    """A finding that ends the audit of a file (nothing further can be read)."""

    def __init__(self, code: str, detail: str, severity: str = CORRUPT) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.severity = severity


def read_header(f: IO[bytes], size: int) -> tuple[dict[str, Any], int]:
    """The safetensors header and where the data starts; ``BadFile`` says why not."""
    if size < 8:
        raise BadFile("not_safetensors", f"not a safetensors file: only {size} bytes")
    (n,) = struct.unpack("<Q", f.read(8))
    if n == 0 or n > MAX_HEADER_BYTES:
        raise BadFile("not_safetensors", f"not a safetensors file: header length {n}")
    raw = f.read(n)
    if len(raw) < n:
        if raw[:1] == b"{":
            raise BadFile("truncated", f"truncated inside the header ({size} of {8 + n}+ bytes)")
        raise BadFile("not_safetensors", f"not a safetensors file: header length {n} > file")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise BadFile("not_safetensors", "not a safetensors file: header is not JSON") from None
    if not isinstance(header, dict):
        raise BadFile("not_safetensors", "not a safetensors file: header is not a JSON object")
    return header, 8 + n


def _is_int(x: Any) -> bool:
    return type(x) is int and x >= 0  # JSON gives int, bool or float: not bool


def check_layout(header: dict[str, Any], data_len: int) -> tuple[dict[str, Any], Problem | None]:
    """Every tensor entry checked as safetensors' loader does (contiguous, sized by shape
    x dtype, ending at the end of the file): the entries and a too short or too long
    file's finding (the caller still reports the shapes the header promises)."""
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
            raise BadFile("bad_header", f"tensor {name!r}: malformed header entry {t!r:.120}")
        if t["dtype"] not in ITEMSIZE:
            raise BadFile(
                "unsupported_dtype",
                f"tensor {name!r}: dtype {t['dtype']!r} is unknown to the audit (its size, "
                "hence the file's layout, cannot be checked)",
                UNSUPPORTED,
            )
        begin, end = t["data_offsets"]
        need = math.prod(t["shape"]) * ITEMSIZE[t["dtype"]]
        if end - begin != need:
            raise BadFile(
                "bad_header",
                f"tensor {name!r}: shape {t['shape']} {t['dtype']} needs {need} bytes, "
                f"offsets give {end - begin}",
            )
        spans.append((begin, end, name))
    expected = 0
    for begin, end, name in sorted(spans):
        if begin != expected:
            raise BadFile("bad_header", f"tensor {name!r}: data at {begin}, expected {expected}")
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


def check_keys(rep: FileReport, tensors: dict[str, Any]) -> tuple[bool, bool]:
    """Keys, dtypes and shapes against the known layouts, into ``rep``: whether
    ``hidden_states`` (with fp8 scales) and ``token_ids`` can be read. No rule:
    ``unsupported``; a known layout damaged: ``corrupt``."""
    hs, ti = tensors.get(HIDDEN_KEY), tensors.get(TOKEN_KEY)
    unknown = sorted(set(tensors) - {HIDDEN_KEY, TOKEN_KEY, SCALES_KEY})
    if hs is None or (ti is None and unknown):
        rep.add(
            "unsupported_layout",
            UNSUPPORTED,
            f"tensors {sorted(tensors)}: not a layout the audit knows ({HIDDEN_KEY} and "
            f"{TOKEN_KEY}, plus {SCALES_KEY} for fp8)",
        )
        return False, False
    if ti is None:
        rep.add("missing_key", CORRUPT, f"missing tensor(s) {[TOKEN_KEY]}; has {sorted(tensors)}")
    elif unknown:
        rep.add(
            "extra_keys",
            SUSPECT,
            f"unexpected tensor(s) {unknown} (the connectors write {HIDDEN_KEY}, "
            f"{TOKEN_KEY} and, fp8, {SCALES_KEY})",
        )

    rep.dtype = hs["dtype"]
    hs_ok = _check_encoding(rep, hs, tensors.get(SCALES_KEY))
    if len(hs["shape"]) != 3:  # no writer the audit knows makes it: no rule, not damage
        rep.format = None
        rep.add(
            "unsupported_layout",
            UNSUPPORTED,
            f"{HIDDEN_KEY} shape {hs['shape']}: the audit knows [tokens, aux layers, "
            "hidden] (3-D) only",
        )
        hs_ok = False
    else:
        rep.n_tokens, rep.n_aux, rep.hidden = hs["shape"]
        if 0 in hs["shape"]:
            rep.add("empty", CORRUPT, f"{HIDDEN_KEY} is empty: shape {hs['shape']}")
            hs_ok = False
        elif rep.format == FP8 and not _check_scales(rep, tensors[SCALES_KEY]):
            hs_ok = False

    return hs_ok, ti is not None and _check_token_ids(rep, ti)


def _check_token_ids(rep: FileReport, ti: dict[str, Any]) -> bool:
    """``token_ids``: I64, 1-D, not empty, one per hidden-state token."""
    ok = True
    if ti["dtype"] not in TOKEN_DTYPES:
        rep.add(
            "unsupported_dtype",
            UNSUPPORTED,
            f"{TOKEN_KEY} dtype {ti['dtype']}: the audit knows I64 token ids only",
        )
        ok = False
    if len(ti["shape"]) != 1:
        rep.add(
            "unsupported_layout",
            UNSUPPORTED,
            f"{TOKEN_KEY} shape {ti['shape']}: the audit knows [tokens] (1-D) only",
        )
        return False
    rep.n_token_ids = ti["shape"][0]
    if rep.n_token_ids == 0:
        ok = False
        if rep.n_tokens != 0:  # an empty hidden_states already said "empty"
            rep.add("empty", CORRUPT, f"{TOKEN_KEY} is empty")
    if rep.n_tokens is not None and rep.n_token_ids != rep.n_tokens:
        rep.token_mismatch = True
        rep.add(
            "token_mismatch",
            CORRUPT,
            f"{rep.n_token_ids} token_ids for {rep.n_tokens} hidden-state tokens",
        )
        ok = False
    return ok


def _check_encoding(rep: FileReport, hs: dict[str, Any], scales: dict[str, Any] | None) -> bool:
    """Which layout the dtypes say (``rep.format``), or an ``unsupported`` finding."""
    dtype = hs["dtype"]
    if scales is None and dtype in HIDDEN_RAW:
        rep.format = PLAIN
        return True
    if scales is None:
        known = f"known: {sorted(HIDDEN_RAW)}, or {FP8_DTYPE} with {SCALES_KEY}"
        why = f"no rule for it ({known})"
        if dtype == FP8_DTYPE:
            why = f"without {SCALES_KEY}, fp8 rows cannot be de-quantized"
        rep.add("unsupported_dtype", UNSUPPORTED, f"{HIDDEN_KEY} dtype {dtype}: {why}")
        return False
    if dtype != FP8_DTYPE:
        rep.add(
            "unsupported_layout",
            UNSUPPORTED,
            f"{SCALES_KEY} beside {dtype} {HIDDEN_KEY}: the audit knows scales for "
            f"{FP8_DTYPE} (float8_e4m3fn) rows only",
        )
        return False
    if scales["dtype"] != SCALES_DTYPE:
        rep.add(
            "unsupported_dtype",
            UNSUPPORTED,
            f"{SCALES_KEY} dtype {scales['dtype']}: the fp8 connector writes {SCALES_DTYPE}",
        )
        return False
    rep.format = FP8
    return True


def _check_scales(rep: FileReport, scales: dict[str, Any]) -> bool:
    """fp8: one scale per token, shaped ``[tokens, 1, 1]`` as the connector writes."""
    shape = scales["shape"]
    if len(shape) != 3 or shape[1:] != [1, 1]:
        rep.format = None
        rep.add(
            "unsupported_layout",
            UNSUPPORTED,
            f"{SCALES_KEY} shape {shape}: the audit knows one scale per token "
            "([tokens, 1, 1]) only",
        )
        return False
    if shape[0] != rep.n_tokens:
        rep.add(
            "scales_mismatch",
            CORRUPT,
            f"{shape[0]} {SCALES_KEY} for {rep.n_tokens} hidden-state tokens",
        )
        return False
    return True


def read_layout(path: str) -> tuple[int, dict[str, Any], int, dict[str, Any], Problem | None]:
    """A file's size, header, data start, tensor entries and layout finding (or None)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header, data_start = read_header(f, size)
    tensors, layout = check_layout(header, size - data_start)
    return size, header, data_start, tensors, layout


def read_token_ids(path: str, offset: int, n: int) -> NDArray[Any]:
    import numpy as np

    return np.fromfile(path, dtype="<i8", count=n, offset=offset)
