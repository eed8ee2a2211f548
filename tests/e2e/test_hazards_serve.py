"""``abort-before-scheduling`` where it kills a job: an engine core of its own process.

* ``vllm serve``, tiny dense Qwen3, ``--max-num-seqs 1``: A runs, B waits and hangs up
  (the server aborts it), C queues. Patched, A and C are answered with right files and
  the server keeps serving; with the release's methods the engine core dies.
Default CI runs the patched server on 0.24.0; the rest is ``extended``. (``LLM`` in
vLLM's default multiprocess layout runs the same engine core: the server covers it.)
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from conftest import RELEASE
from support.abort import (
    AUX_IDS,
    PROMPT_LEN,
    compare_files,
    model_dir,
    prompts,
    right,
    serving,
)
from support.lockfile import written
from support.serve import healthy, post

from hsfix_demo import e2e
from vllm_hsfix.patches import by_id

pytestmark = [pytest.mark.e2e, pytest.mark.needs_vllm]

PATCH = by_id("abort-before-scheduling")
DISABLE = {"VLLM_HSFIX_DISABLED_PATCHES": PATCH.id}
DEFAULT_RELEASE = "0.24.0"  # the one release whose patched server runs in default CI
# A keeps the one slot busy while B waits and hangs up: prompt 50 + 450 <= 512.
A_TOKENS = 450


default_on_024 = [] if RELEASE == DEFAULT_RELEASE else [pytest.mark.extended]


def _completion(base: str, ids: list[int], max_tokens: int, timeout: float = 180) -> Any:
    body = {"model": str(model_dir()), "prompt": ids, "max_tokens": max_tokens}
    body.update(temperature=0.0, ignore_eos=True)
    try:
        return post(base + "/v1/completions", body, timeout)
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        return {"error": repr(exc)}


def _metric(base: str, name: str) -> float | None:
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    found = re.search(rf"^vllm:{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    return float(found.group(1)) if found else None


def disconnect_while_queued(server: dict[str, Any]) -> dict[str, Any]:
    """A runs; B is sent, waits behind A and hangs up; C queues; A and C are awaited."""
    base, p = server["base"], prompts()
    got: dict[str, Any] = {}
    a = threading.Thread(target=lambda: got.update(A=_completion(base, p[0], A_TOKENS)))
    a.start()
    deadline = time.monotonic() + 30
    while (_metric(base, "num_requests_running") or 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    # B: a raw connection, so that it can hang up without reading the answer.
    body = json.dumps({"model": str(model_dir()), "prompt": p[2], "max_tokens": 1})
    b = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=30)
    b.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    deadline = time.monotonic() + 10
    while (_metric(base, "num_requests_waiting") or 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    state = {
        "running": _metric(base, "num_requests_running"),
        "waiting": _metric(base, "num_requests_waiting"),
    }
    b.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
    b.close()
    time.sleep(1.0)  # the server notices the hang-up and aborts B (still waiting)
    c = threading.Thread(target=lambda: got.update(C=_completion(base, p[1], 1)))
    c.start()
    a.join(240)
    c.join(240)
    paths = {
        k: (v.get("kv_transfer_params") or {}).get("hidden_states_path")
        for k, v in got.items()
        if "error" not in v
    }
    deadline = time.monotonic() + 60
    while paths and not all(written(x or "") for x in paths.values()):
        if time.monotonic() > deadline or not healthy(base):
            break
        _completion(base, [1, 2, 3], 1, timeout=30)  # steps the engine: the saves finish
        time.sleep(0.5)
    later = _completion(base, p[1][:10], 1, timeout=60)
    return {
        "b_hung_up_with": state,
        "answers": {k: ("error" if "error" in v else "ok") for k, v in got.items()},
        "errors": {k: v["error"] for k, v in got.items() if "error" in v},
        "paths": paths,
        "healthy_after": healthy(base),
        "later_request": "error" if "error" in later else "ok",
    }


@pytest.mark.applies("abort-before-scheduling")
@pytest.mark.parametrize("case", [pytest.param("patched", marks=default_on_024)])
def test_serve_survives_a_client_that_hangs_up_while_queued(
    case: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    work = tmp_path_factory.mktemp("serve-abort")
    with serving(work) as server:
        result = disconnect_while_queued(server)
        log = server["log"].read_text(errors="replace")
    print(json.dumps({**result, "startup_s": round(server["startup_s"], 1)}, indent=1))
    state = result["b_hung_up_with"]
    assert state == {"running": 1.0, "waiting": 1.0}, f"B was not queued behind A: {state}"
    assert e2e.DEATH_MARKERS.search(log) is None, e2e.log_excerpt(server["log"])
    assert result["answers"] == {"A": "ok", "C": "ok"}, result
    assert result["healthy_after"] and result["later_request"] == "ok", result
    p = prompts()
    report = compare_files(result["paths"], {"A": p[0], "C": p[1]})
    print(report)
    for rid, r in report.items():
        assert r["shape"][:2] == (PROMPT_LEN, len(AUX_IDS)), (rid, r)
        assert right(r), (rid, r)


@pytest.mark.applies("abort-before-scheduling")
@pytest.mark.extended
def test_serve_without_the_patch_dies_when_a_queued_client_hangs_up(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Failing first: the same server and clients with the release's own methods."""
    work = tmp_path_factory.mktemp("serve-abort-release")
    with serving(work, **DISABLE) as server:
        result = disconnect_while_queued(server)
        log = server["log"].read_text(errors="replace")
    print(json.dumps(result, indent=1))
    assert result["b_hung_up_with"] == {"running": 1.0, "waiting": 1.0}, result
    assert "EngineCore encountered a fatal error" in log, e2e.log_excerpt(server["log"])
    assert re.search(r"KeyError: '[^']+'", log), e2e.log_excerpt(server["log"])
    assert "request_finished" in log, e2e.log_excerpt(server["log"])
    assert result["answers"].get("A") != "ok" or not result["healthy_after"], result
