"""Connector-shaped hidden-states files written with numpy alone (bare data boxes), rows
causal as a model's, so files sharing a prompt prefix share those rows."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

A, H = 3, 64
TEMPLATE = [7, 8, 9, 10, 11, 12]


def write_hs(path: Path, hs: np.ndarray, ids: list[int]) -> Path:
    """``hs`` float32 [tokens, n_aux, hidden] saved as BF16 (truncated), ``ids`` as I64."""
    bf16 = (np.ascontiguousarray(hs, dtype=np.float32).view(np.uint32) >> 16).astype("<u2")
    tok = np.asarray(ids, dtype="<i8")
    n_hs = bf16.nbytes
    end = n_hs + tok.nbytes
    header = {
        "hidden_states": {"dtype": "BF16", "shape": list(hs.shape), "data_offsets": [0, n_hs]},
        "token_ids": {"dtype": "I64", "shape": [len(tok)], "data_offsets": [n_hs, end]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + bf16.tobytes() + tok.tobytes())
    return path


def causal_rows(ids: list[int], seed: int, noise: float = 0.02, hidden: int = H) -> np.ndarray:
    noise_rng = np.random.default_rng(10_000 + seed)
    rows = []
    for p in range(len(ids)):
        key = hashlib.sha256(str(ids[: p + 1]).encode()).digest()
        row = np.random.default_rng(int.from_bytes(key[:7], "little")).standard_normal((A, hidden))
        rows.append(row * (1 + noise * noise_rng.standard_normal((A, hidden))))
    return np.stack(rows).astype(np.float32)


def causal_dataset(
    root: Path,
    n: int,
    wrong: frozenset[int] = frozenset(),
    zero: frozenset[int] = frozenset(),
    tokens: tuple[int, int] = (4, 30),
    hidden: int = H,
) -> list[Path]:
    """``n`` chat-like files (template prefix + random tail). Files in ``wrong`` hold
    rows from elsewhere (prefix mismatch); files in ``zero`` have one all-zero row."""
    rng = np.random.default_rng(1)
    paths = []
    for i in range(n):
        tail = rng.integers(100, 30_000, int(rng.integers(*tokens))).tolist()
        ids = TEMPLATE + tail
        hs = causal_rows(ids, seed=i, hidden=hidden)
        if i in wrong:
            hs = np.random.default_rng(500 + i).standard_normal(hs.shape).astype(np.float32)
        if i in zero:
            hs[len(ids) // 2] = 0.0
        paths.append(write_hs(root / f"f{i:04d}.safetensors", hs, ids))
    return paths
