"""speculators' pipeline driven as its users drive it, from the layers the ``speculators``
row builds. ``scripts/launch_vllm.py`` is not in its wheel: :func:`launcher_command`
restates its rules."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from support import hsrows
from support.extraction import speculative_config

HS_LAYER = "VLLM_HSFIX_LAYER_HS_CONNECTORS"
SPEC_LAYER = "VLLM_HSFIX_LAYER_SPECULATORS"


def layer(var: str) -> str:
    path = os.environ.get(var)
    if not path or not Path(path).is_dir():
        raise AssertionError(
            f"{var} is not set to a layer directory: run this test through "
            "`python3 scripts/run_tests.py --only speculators` (it builds the layers)"
        )
    return path


def worst(got: Any, want: Any) -> float:
    """The largest relative L2 error of a row of ``got`` against ``want``."""
    return float(hsrows.rel_errors(got, want).max())


def num_hidden_layers(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    return int(config.get("text_config", config)["num_hidden_layers"])


def launcher_command(
    model: Path, backend: str, target_layers: list[int], hidden_states_path: Path, *vllm_args: str
) -> tuple[list[str], list[int]]:
    """The command speculators' launcher execs, and the aux layer ids it asked for."""
    from hs_connectors import HiddenStatesBackend

    layers = list(target_layers)
    n = num_hidden_layers(model)
    if n not in layers:
        layers.append(n)  # --include-last-layer, on by default
    args = argparse.Namespace(hidden_states_path=str(hidden_states_path))
    kv_transfer = HiddenStatesBackend.registry[backend].build_kv_transfer_config(args)
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
        "--speculative_config", json.dumps(speculative_config(layers)),
        "--kv_transfer_config", json.dumps(kv_transfer),
        *vllm_args,
    ]  # fmt: skip
    return cmd, layers


def write_dataset(where: Path, prompts: list[list[int]]) -> Path:
    """A preprocessed dataset as ``speculators prepare-data`` leaves it (the columns
    ``generate-offline-data`` and ``ArrowDataset`` read), saved with ``datasets``."""
    import datasets
    import pyarrow as pa

    table = pa.table(
        {
            "input_ids": prompts,
            "loss_mask": [[1] * len(p) for p in prompts],
            "seq_len": [len(p) for p in prompts],
        }
    )
    # A fingerprint of our own: datasets 5.1.0's dill hash of a new table fails in the
    # release venv (PicklingError on pyarrow's MonthDayNano), not what is tested here.
    ds = datasets.Dataset(datasets.table.InMemoryTable(table), fingerprint="hsfix-speculators")
    ds = ds.with_format("torch")
    ds.save_to_disk(str(where))
    return where


def online(
    endpoint: str, dataset: Path, backend: str, scratch: Path, concurrency: int
) -> list[dict[str, Any]]:
    """Every sample through ``ArrowDataset(on_missing="generate")``, ``concurrency`` at a
    time, as training reads it (no cached file, so each item asks vLLM)."""
    from concurrent.futures import ThreadPoolExecutor

    from hs_connectors.transfer import FileTransfer, FP8Transfer
    from speculators.train.data import ArrowDataset

    scratch.mkdir(parents=True, exist_ok=True)
    transfer = FP8Transfer(scratch) if backend == "fp8" else FileTransfer(scratch)
    ds = ArrowDataset(
        max_len=4096, datapath=dataset, transfer=transfer, vllm_endpoint=endpoint,
        on_missing="generate",
    )  # fmt: skip
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(ds.__getitem__, range(len(ds))))


def pipeline(
    work: Path,
    model: Path,
    dataset: Path,
    backend: str,
    target_layers: list[int],
    model_args: tuple[str, ...],
    *,
    off: str = "",
    with_online: bool = True,
    concurrency: int = 8,
    server_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Serve (the launcher's command, ``model_args`` for the model), run
    ``generate-offline-data`` (and the online path), shut down: what happened, where."""
    import subprocess

    from conftest import INSTALL, clean_env

    from support import serve

    overlay = str(Path(INSTALL.location or "").parent.parent)
    port = serve.free_port()
    cmd, aux = launcher_command(
        model, backend, target_layers, work / "vllm-out",
        "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
        "--dtype", "bfloat16", *model_args,
        "--max-model-len", "512", "--enforce-eager", "--distributed-executor-backend", "mp",
    )  # fmt: skip
    env = clean_env(
        PYTHONPATH=os.pathsep.join([overlay, layer(HS_LAYER)]),
        VLLM_HSFIX_STATUS_DIR=str(work / "status"),
        VLLM_HSFIX_DISABLED_PATCHES=off or None,
        **(server_env or {}),
    )
    client_env = clean_env(
        PYTHONPATH=os.pathsep.join([overlay, layer(SPEC_LAYER)]),
        VLLM_HSFIX_DISABLE="1",  # the client is not vLLM: nothing to patch there
    )
    out = work / "hidden_states"
    result: dict[str, Any] = {"aux": aux, "out": out, "online": None}
    # speculators 0.9.0's --validate-outputs skips every fp8 file, with or without
    # vllm-hsfix (torch.aminmax is not implemented for float8_e4m3fn on the CPU).
    validate = ["--validate-outputs"] if backend == "file" else []
    with serve.running(cmd, env, work / "server.log", port) as base:
        gen = subprocess.run(
            [
                sys.executable, "-m", "speculators", "generate-offline-data",
                "--endpoint", f"{base}/v1", "--preprocessed-data", str(dataset),
                "--output", str(out), "--concurrency", str(concurrency), *validate,
            ],
            env=client_env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        result["generate"] = gen
        if with_online:
            result["online"] = online(f"{base}/v1", dataset, backend, work / "online", concurrency)
    return result
