"""The ``vllm serve`` path: the real console script, as a user types it (on vLLM's CPU
build it starts through vllm-hsfix's ``cpu-dist-name`` fix, installed by pip and nothing
else), spawn start method, OpenAI completions with token-id prompts, the file path
returned in ``kv_transfer_params``.

The server starts on 127.0.0.1 with vllm-hsfix active only through its plugin, and is
always shut down.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import CACHE, clean_env, cli_rows_as_declared, declared_all
from support.lockfile import written
from support.serve import free_port, post, serve_command

from hsfix_demo import e2e, tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.needs_vllm, pytest.mark.applies("scatter-clamp")]
AUX = [1, 2, 3]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    work = tmp_path_factory.mktemp("serve")
    model = tiny_model.build(CACHE / "models" / "hybrid", "hybrid")
    port = free_port()
    env = clean_env(
        VLLM_HSFIX_STATUS_DIR=str(work / "status"), VLLM_WORKER_MULTIPROC_METHOD="spawn"
    )
    plugins = e2e.plugin_dir(work)
    env["PYTHONPATH"] = f"{plugins}{os.pathsep}{env['PYTHONPATH']}"
    cmd = serve_command(
        model, port, work / "hs", AUX, 256,
        "--mamba-ssm-cache-dtype", "float32", "--language-model-only",
        "--distributed-executor-backend", "mp",
    )  # fmt: skip
    log = open(work / "server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        offset = 0
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited: {(work / 'server.log').read_text()[-3000:]}")
            # A dead engine can leave the API process up: fail at once with the cause.
            death, offset = e2e.death_in_log(work / "server.log", offset)
            if death is not None:
                raise AssertionError(
                    f"vLLM died while starting ({death}):\n" + e2e.log_excerpt(work / "server.log")
                )
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("server did not become healthy in 300 s")
            time.sleep(2)
        yield {"base": base, "model": str(model), "work": work}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        log.close()


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
    while not all(written(p) for p in paths):
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
    # Every patch the table declares, applied in the worker (rows on the CLI module:
    # applied where the worker re-imported the console script's module, else pending).
    got = roles["worker-0"]["patches"]
    statuses = {p: got[p]["status"] for p in got}
    assert cli_rows_as_declared(statuses) == declared_all(), statuses
    assert roles["worker-0"]["verify"]["ok"] is True
