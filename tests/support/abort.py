"""The abort-before-scheduling cases: the tiny dense Qwen3, three 50-token prompts, aux
layers 1-3, each request's file checked against a transformers forward of its prompt."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from conftest import CACHE, clean_env

from support.serve import free_port, running, serve_command

AUX_IDS = [1, 2, 3]
PROMPT_LEN = 50
THRESHOLD = 0.1  # relative L2 per row, as demo/e2e.py (measured: right rows 0.01-0.06)
MAX_MODEL_LEN = 512  # the tiny model's max_position_embeddings


def prompts() -> list[list[int]]:
    import torch

    from hsfix_demo import tiny_model

    gen = torch.Generator().manual_seed(7)
    return [
        torch.randint(4, tiny_model.TEXT_VOCAB, (PROMPT_LEN,), generator=gen).tolist()
        for _ in range(3)
    ]


def model_dir() -> Path:
    from hsfix_demo import tiny_model

    return tiny_model.build(CACHE / "models" / "dense", "dense")


def compare_files(paths: dict[str, str | None], expected: dict[str, list[int]]) -> dict[str, Any]:
    """Each request's file against its prompt and a transformers forward: token ids, shape,
    and per position whether any aux row is off (relative L2 >= THRESHOLD)."""
    from safetensors.torch import load_file

    from support import hsrows

    model = hsrows.load(model_dir())
    report: dict[str, Any] = {}
    for rid, ids in expected.items():
        path = paths.get(rid)
        assert path and Path(path).exists(), (rid, path)
        data = load_file(path)
        got = data["hidden_states"]
        want = hsrows.rows(model, ids, AUX_IDS)
        entry: dict[str, Any] = {
            "token_ids_match": data["token_ids"].tolist() == ids,
            "shape": tuple(got.shape),
            "want_shape": tuple(want.shape),
        }
        if got.shape == want.shape:
            bad = ~(hsrows.rel_errors(got, want) < THRESHOLD)
            entry["wrong_positions"] = bad.any(dim=1).nonzero().flatten().tolist()
            entry["rows_wrong"] = int(bad.sum())
        report[rid] = entry
    return report


def right(entry: dict[str, Any]) -> bool:
    return bool(
        entry["token_ids_match"]
        and entry["shape"] == entry["want_shape"]
        and entry["rows_wrong"] == 0
    )


@contextlib.contextmanager
def serving(work: Path, **extra_env: str) -> Iterator[dict[str, Any]]:
    """A ``vllm serve`` of the tiny dense model, ``--max-num-seqs 1``; killed after."""
    port = free_port()
    cmd = serve_command(
        model_dir(), port, work / "hs", AUX_IDS, MAX_MODEL_LEN, "--max-num-seqs", "1"
    )
    log_path = work / "server.log"
    t0 = time.monotonic()
    with running(cmd, clean_env(**extra_env), log_path, port) as base:
        yield {"base": base, "port": port, "log": log_path, "startup_s": time.monotonic() - t0}
