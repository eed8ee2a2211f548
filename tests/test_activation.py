"""One activation, whatever fires, in fresh processes with the real vLLM."""

from __future__ import annotations

import pytest
from conftest import CONNECTOR_MODULE, MODEL_MODULE, clean_env, declared_all, last_json, run_py

from vllm_hsfix._version import __version__

# The children assert 0.24.0's answers (every target of TARGETS wrapped once,
# `_zero_block_ids` and `register_kv_caches` included): the releases where
# hidden-group-block-size applies, not every release of the clamp.
pytestmark = [pytest.mark.needs_vllm, pytest.mark.applies("hidden-group-block-size")]

TARGETS = f"""
import importlib
MODEL = importlib.import_module("{MODEL_MODULE}")
CONN = importlib.import_module("{CONNECTOR_MODULE}")
RUNNER = importlib.import_module("vllm.v1.worker.cpu_model_runner")
CLI = importlib.import_module("vllm.entrypoints.cli.main")
"""

WRAP_REPORT = """
def depth(obj):
    n = 0
    while getattr(obj, "hsfix_patch", None) is not None:
        n, obj = n + 1, obj.__wrapped__
    return n
C = CONN.ExampleHiddenStatesConnector.__dict__
REPORT = {
    "basic_cache": depth(MODEL.basic_cache),
    "__init__": depth(C["__init__"]),
    "register_kv_caches": depth(C["register_kv_caches"]),
    "_zero_block_ids": depth(RUNNER.CPUModelRunner.__dict__["_zero_block_ids"]),
}
"""
# Each target wrapped exactly once, by us.
ONCE = dict.fromkeys(["basic_cache", "__init__", "register_kv_caches", "_zero_block_ids"], 1)


def test_status_after_import_shows_both_patches_applied_and_one_log_line() -> None:
    out = run_py(
        "import json, vllm_hsfix\n"
        + TARGETS
        + WRAP_REPORT
        + """
st = vllm_hsfix.status()
print(json.dumps([{k: v["status"] for k, v in st["patches"].items()}, REPORT,
                  st["activated_by"]]))
"""
    )
    statuses, depths, sources = last_json(out.stdout)
    assert statuses == declared_all()
    assert depths == ONCE
    assert sources == ["import", "vllm-import"]
    lines = [ln for ln in out.stderr.splitlines() if f"vllm-hsfix {__version__} pid=" in ln]
    assert len(lines) == 1, out.stderr[-3000:]
    # Logged when vLLM is imported, decided from the files: patched on import.
    on_import = "scatter-clamp, hidden-group-block-size, aux-final-layer, cpu-zero-blocks"
    assert f"on import {on_import}" in lines[0]
    assert "role=main" in lines[0] and "vllm=0.24.0" in lines[0]


@pytest.mark.parametrize("order", ["targets-first", "package-first"])
def test_import_plugin_bootstrap_and_apply_patch_once(order: str) -> None:
    from vllm_hsfix.cli import BOOTSTRAP_DIR

    activate = """
import vllm_hsfix
from vllm.plugins import load_general_plugins
load_general_plugins()
vllm_hsfix.apply(); vllm_hsfix.apply()
import _vllm_hsfix_plugin; _vllm_hsfix_plugin.register()
"""
    body = (TARGETS + activate) if order == "targets-first" else (activate + TARGETS)
    env = clean_env(PYTHONPATH=f"{BOOTSTRAP_DIR}:" + clean_env()["PYTHONPATH"])
    out = run_py(
        "import json\n"
        + body
        + WRAP_REPORT
        + """
st = vllm_hsfix.status()
print(json.dumps([REPORT, st["activated_by"], {k: v["status"] for k, v in st["patches"].items()}]))
""",
        env=env,
    )
    depths, sources, statuses = last_json(out.stdout)
    assert depths == ONCE
    assert sources[0] == "bootstrap"
    # `import vllm_hsfix` after the bootstrap finds the module already imported: no event.
    assert {"bootstrap", "plugin", "apply"} <= set(sources)
    assert set(statuses.values()) == {"applied"}


def test_concurrent_activation_from_threads_patches_once() -> None:
    out = run_py(
        "import json, threading\n"
        + TARGETS
        + """
import vllm_hsfix
barrier = threading.Barrier(8)
def go():
    barrier.wait()
    vllm_hsfix.apply()
ts = [threading.Thread(target=go) for _ in range(8)]
[t.start() for t in ts]; [t.join() for t in ts]
"""
        + WRAP_REPORT
        + "print(json.dumps(REPORT))"
    )
    assert last_json(out.stdout) == ONCE


def test_disable_switches() -> None:
    code = (
        "import json, vllm_hsfix\n"
        + TARGETS
        + WRAP_REPORT
        + """
st = vllm_hsfix.status()
print(json.dumps([REPORT, {k: v["code"] for k, v in st["patches"].items()}]))
"""
    )
    off = last_json(run_py(code, env=clean_env(VLLM_HSFIX_DISABLE="1")).stdout)
    assert off == [
        dict.fromkeys(ONCE, 0),
        {
            pid: ("disabled" if st == "applied" else "not-needed")
            for pid, st in declared_all().items()
        },
    ]
    one = last_json(run_py(code, env=clean_env(VLLM_HSFIX_DISABLED_PATCHES="scatter-clamp")).stdout)
    assert one == [
        {**ONCE, "basic_cache": 0},
        {
            **{
                pid: ("applied" if st == "applied" else "not-needed")
                for pid, st in declared_all().items()
            },
            "scatter-clamp": "disabled",
        },
    ]


FORCE_FAILURE = """
import vllm_hsfix.detect as d
def broken(*a, **k):
    raise RuntimeError("forced failure inside activation")
d.detect = broken
"""


@pytest.mark.parametrize("strict", [False, True])
def test_a_failure_inside_activation_escapes_only_in_strict_mode(strict: bool) -> None:
    code = (
        "import json\n"
        + FORCE_FAILURE
        + """
import vllm_hsfix
try:
"""
        + "\n".join("    " + ln for ln in TARGETS.strip().splitlines())
        + """
    raised = None
except Exception as exc:
    raised = type(exc).__name__ + ": " + str(exc)
st = vllm_hsfix.status() if raised is None else None
print(json.dumps([raised, st and {k: v["code"] for k, v in st["patches"].items()}]))
"""
    )
    env = clean_env(VLLM_HSFIX_STRICT="1" if strict else None)
    out = run_py(code, env=env)
    if strict:
        # the status() call itself would re-raise, so only the import result is checked
        raised = last_json(out.stdout)[0]
        assert raised is not None and raised.startswith("HsfixError")
        assert "forced failure inside activation" in raised
    else:
        raised, codes = last_json(out.stdout)
        assert raised is None, raised
        assert codes == dict.fromkeys(declared_all(), "error")
        assert "forced failure inside activation" in out.stderr


@pytest.mark.parametrize("strict", [False, True])
def test_plugin_never_raises_into_vllm_unless_strict(strict: bool) -> None:
    code = """
import json
import vllm_hsfix._lazy as lazy
def broken(*args):
    raise RuntimeError("forced failure in the plugin")
lazy.activate = broken
import _vllm_hsfix_plugin
try:
    _vllm_hsfix_plugin.register()
    raised = None
except BaseException as exc:
    raised = type(exc).__name__
print(json.dumps(raised))
"""
    out = run_py(code, env=clean_env(VLLM_HSFIX_STRICT="1" if strict else None))
    assert last_json(out.stdout) == ("HsfixError" if strict else None)
    assert "forced failure in the plugin" in out.stderr
