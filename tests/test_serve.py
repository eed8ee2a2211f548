"""The ``vllm serve`` path: the real console script, as a user types it (on vLLM's CPU
build it starts through vllm-hsfix's ``cpu-dist-name`` fix), spawn start method, OpenAI
completions with token-id prompts, the file path returned in ``kv_transfer_params``.
vllm-hsfix is active only through its plugin; the server is always shut down."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import CACHE, clean_env, cli_rows_as_declared, declared_all
from support.lockfile import written
from support.serve import free_port, post, running, serve_command

from hsfix_demo import e2e, tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.needs_vllm, pytest.mark.applies("scatter-clamp")]
AUX = [1, 2, 3]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("serve")
    model = tiny_model.build(CACHE / "models" / "hybrid", "hybrid")
    port = free_port()
    env = clean_env(
        VLLM_HSFIX_STATUS_DIR=str(work / "status"), VLLM_WORKER_MULTIPROC_METHOD="spawn"
    )
    env["PYTHONPATH"] = f"{e2e.plugin_dir(work)}{os.pathsep}{env['PYTHONPATH']}"
    cmd = serve_command(
        model, port, work / "hs", AUX, 256,
        "--mamba-ssm-cache-dtype", "float32", "--language-model-only",
        "--distributed-executor-backend", "mp",
    )  # fmt: skip
    with running(cmd, env, work / "server.log", port) as base:
        yield {"base": base, "model": str(model), "work": work}


def test_served_hidden_states_match_the_reference(server: dict) -> None:
    from safetensors.torch import load_file

    batch = e2e.prompts()
    paths = []
    for ids in batch:
        resp = post(
            server["base"] + "/v1/completions",
            {"model": server["model"], "prompt": ids, "max_tokens": 1},
        )
        paths.append(resp["kv_transfer_params"]["hidden_states_path"])
    deadline = time.monotonic() + 120
    while not all(written(p) for p in paths):  # a finished request is saved a step later
        assert time.monotonic() < deadline, "hidden-states files were not written"
        post(
            server["base"] + "/v1/completions",
            {"model": server["model"], "prompt": [1, 2, 3], "max_tokens": 1},
        )
        time.sleep(1)
    saved = [load_file(p) for p in paths]
    got = e2e.compare(saved, e2e.reference(Path(server["model"]), batch, tuple(AUX)), batch)
    assert got["rows_correct"] == got["rows"] > 0, got


def test_every_server_process_is_patched(server: dict) -> None:
    statuses = [json.loads(f.read_text()) for f in (server["work"] / "status").glob("*.json")]
    roles = {s["role"]: s for s in statuses}
    assert {"engine-core", "worker-0"} <= set(roles), list(roles)
    # Every row the table declares, in the worker (cli_rows_as_declared: the CLI rows).
    got = {p: v["status"] for p, v in roles["worker-0"]["patches"].items()}
    assert cli_rows_as_declared(got) == declared_all(), got
    assert roles["worker-0"]["verify"]["ok"] is True
