"""A real ``vllm serve`` for a test, in a session of its own killed whole afterwards;
waiting for it fails at once, with vLLM's words, when it exits or its log says it died."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from hsfix_demo.e2e import DEATH_MARKERS
from support.extraction import kv_transfer_config, speculative_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def console_script() -> str:
    """The ``vllm`` console script of the vLLM under test, as a user types ``vllm``: the
    one installed beside the release (``bin/`` of its site, or of this interpreter)."""
    import vllm_hsfix.detect as detect

    location = detect.detect().location or ""
    for cand in (
        Path(location).parent.parent / "bin" / "vllm",
        Path(sys.executable).parent / "vllm",
    ):
        if cand.is_file():
            return str(cand)
    raise AssertionError(f"no vllm console script beside {location} or {sys.executable}")


def serve_command(
    model: Path, port: int, storage: Path, aux: list[int], max_model_len: int, *extra: str
) -> list[str]:
    """``vllm serve`` of ``model`` on 127.0.0.1 extracting ``aux`` into ``storage`` (prefix
    caching and chunked prefill off), plus ``extra`` arguments."""
    return [
        console_script(), "serve", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
        "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", str(max_model_len),
        "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
        "--speculative-config", json.dumps(speculative_config(aux)),
        "--kv-transfer-config", json.dumps(kv_transfer_config(str(storage))),
        *extra,
    ]  # fmt: skip


def healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:  # HTTPError included
        return False


def tail(log: Path, limit: int = 4000) -> str:
    try:
        return log.read_text(errors="replace")[-limit:]
    except OSError:
        return "(no log)"


def post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


@contextlib.contextmanager
def running(
    cmd: list[str], env: dict[str, str], log: Path, port: int, start_timeout: float = 300
) -> Iterator[str]:
    """Start ``cmd`` on ``port``, wait for ``/health``, yield its URL; kill its session after."""
    out = open(log, "w")  # noqa: SIM115
    proc = subprocess.Popen(
        cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"vllm serve exited ({proc.returncode}):\n{tail(log)}")
            text = tail(log, 1 << 20)
            if DEATH_MARKERS.search(text):  # the words the demo's runner watches for
                time.sleep(2)  # let the traceback finish
                raise AssertionError(f"vllm serve died while starting:\n{tail(log)}")
            if healthy(base):
                break
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"vllm serve not healthy in {start_timeout:.0f} s:\n{tail(log)}"
                )
            time.sleep(1)
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        out.close()
