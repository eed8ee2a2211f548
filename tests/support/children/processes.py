"""A function run in forked and spawned children by test_startup_line.py (importable under
spawn as ``support.children.processes``), and a command run by path by test_processes.py."""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

TARGETS = (
    "vllm.model_executor.models.extract_hidden_states",
    "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
    "vllm.v1.worker.cpu_model_runner",
)


def report() -> dict[str, Any]:
    """Import the targets the way a vLLM worker does, then read this process's status."""
    for name in TARGETS:
        importlib.import_module(name)
    if "vllm_hsfix" not in sys.modules:
        return {"pid": os.getpid(), "active": False}
    st = sys.modules["vllm_hsfix"].status()
    return {
        "pid": os.getpid(),
        "active": True,
        "sources": st["activated_by"],
        "patches": {k: v["status"] for k, v in st["patches"].items()},
    }


def plugins_and_print() -> None:
    """A child (forked or spawned) that loads the general plugins as vLLM's workers do,
    then prints its pid: its own vllm-hsfix line must come first."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    print("CHILD", os.getpid(), flush=True)


if __name__ == "__main__":
    # Used as a command: print this process's report, and optionally a child's.
    out = report()
    if sys.argv[1:] == ["--child"]:
        import subprocess

        child = subprocess.run([sys.executable, __file__], capture_output=True, text=True)
        out["child"] = json.loads(child.stdout.strip().splitlines()[-1])
    print(json.dumps(out))
