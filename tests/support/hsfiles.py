"""Hidden-states files as the connector (or a broken vLLM) writes them: :func:`hs_file`,
:func:`make_mixed` (good, corrupt, suspect, junk) and :func:`dataset` (causal rows)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from support import npfiles

T, A, H = 64, 3, 256  # hs_file's default shape: tokens, aux layers, hidden size
PREFIX_AUX, PREFIX_HIDDEN = npfiles.A, npfiles.H  # dataset's rows
TEMPLATE = npfiles.TEMPLATE  # a chat template's first tokens: a shared prefix


def hs_file(
    path: Path,
    *,
    tokens: int = T,
    n_aux: int = A,
    hidden: int = H,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    scale: float = 1.0,
    edit: object = None,
) -> Path:
    """A connector-like file of random rows and ids; ``edit(hs, ids)`` damages them in place."""
    g = torch.Generator().manual_seed(seed)
    hs = (torch.randn(tokens, n_aux, hidden, generator=g) * scale).to(dtype)
    ids = torch.randint(0, 32000, (tokens,), generator=g, dtype=torch.int64)
    if callable(edit):
        edit(hs, ids)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"hidden_states": hs.contiguous(), "token_ids": ids}, str(path))
    return path


def write_raw(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def make_mixed(root: Path) -> dict[str, Path]:
    """4 good, 1 corrupt (zero rows), 1 suspect (duplicates), 1 not safetensors."""
    out = {f"good{i}": hs_file(root / f"good{i}.safetensors", seed=i) for i in range(4)}

    def dup(hs: torch.Tensor, ids: torch.Tensor) -> None:
        ids[:] = torch.arange(len(ids))
        hs[9, 1] = hs[2, 1]

    out["zero"] = hs_file(root / "zero.safetensors", seed=10, edit=lambda h, i: h[3, 0].zero_())
    out["dup"] = hs_file(root / "dup.safetensors", seed=11, edit=dup)
    out["junk"] = write_raw(root / "junk.safetensors", b"not tensors at all" * 10)
    return out


def write(path: Path, ids: list[int], hs: torch.Tensor) -> Path:
    save_file(
        {"hidden_states": hs.to(torch.bfloat16).contiguous(), "token_ids": torch.tensor(ids)},
        str(path),
    )
    return path


def dataset(
    root: Path,
    wrong: set[int] = frozenset(),
    n_shared: int = 20,
    n_alone: int = 5,
    scale: float = 1.0,
) -> list[Path]:
    """``n_shared`` chat-like files (template prefix + random tail), ``n_alone`` others.
    Files whose index is in ``wrong`` hold rows from elsewhere (each its own)."""
    g = torch.Generator().manual_seed(1)
    paths = []
    for i in range(n_shared + n_alone):
        tail = torch.randint(
            100, 30_000, (int(torch.randint(4, 30, (1,), generator=g)),), generator=g
        )
        ids = (TEMPLATE if i < n_shared else []) + tail.tolist()
        if i >= n_shared:
            ids = [40_000 + i, *ids]  # a first token nobody else has
        hs = torch.from_numpy(npfiles.causal_rows(ids, seed=i, noise=0.02, hidden=PREFIX_HIDDEN))
        if i in wrong:
            hs = torch.randn(hs.shape, generator=torch.Generator().manual_seed(500 + i)) * 1.1
        paths.append(write(root / f"f{i:03d}.safetensors", ids, hs * scale))
    return paths
