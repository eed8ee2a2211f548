"""Processes started as vLLM starts them: ``startup.py CASE [ARG]``; marker lines
(``PLUGINS-LOADED``, ``STATUS ...``) order the output against vllm-hsfix's line, and a
result, if any, is the last line, as JSON."""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

from support.children import CONNECTOR_MODULE, MODEL_MODULE, main


def worker(runner: str) -> None:
    """A worker's import order: plugins first, then model, connector, model runner."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    print("PLUGINS-LOADED", flush=True)
    for name in (MODEL_MODULE, CONNECTOR_MODULE, runner):
        importlib.import_module(name)
    import vllm_hsfix

    st = vllm_hsfix.status()
    print("STATUS", sorted((k, v["code"]) for k, v in st["patches"].items()), flush=True)


def api() -> None:
    """The API process: vllm-hsfix, then vLLM, and no target."""
    for name in ("vllm_hsfix", "vllm"):  # in this order
        importlib.import_module(name)

    print("VLLM-IMPORTED", flush=True)
    ends = ("extract_hidden_states", "example_hidden_states_connector", "cpu_model_runner")
    print("TARGETS", [m for m in sys.modules if m.endswith(ends)], flush=True)


def fork_and_spawn() -> None:
    """The parent, then a forked and a spawned child loading the plugins."""
    import multiprocessing

    for name in ("vllm_hsfix", "vllm"):  # in this order
        importlib.import_module(name)

    from support.children import processes

    print("PARENT", os.getpid(), flush=True)
    for method in ("fork", "spawn"):
        p = multiprocessing.get_context(method).Process(target=processes.plugins_and_print)
        p.start()
        p.join()
        assert p.exitcode == 0, p.exitcode


def plugins() -> dict[str, Any]:
    """vllm-hsfix imported, vLLM's plugin call, then a worker's imports: the report."""
    importlib.import_module("vllm_hsfix")  # before vLLM's plugin module
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from support.children import processes

    return processes.report()


def gpu_worker(mark: str) -> dict[str, Any]:
    """What a GPU worker does: vLLM's plugin call (activation), ``mark`` printed, then
    the model module, the connector, the GPU model runner and the scheduler (the engine
    core's: ``drafter-skip-guard``'s target)."""
    from vllm.plugins import load_general_plugins

    assert "vllm_hsfix" not in sys.modules
    load_general_plugins()
    early = sys.modules["vllm_hsfix"].status()
    print(mark, flush=True)
    runner, scheduler = "vllm.v1.worker.gpu_model_runner", "vllm.v1.core.sched.scheduler"
    for name in (MODEL_MODULE, CONNECTOR_MODULE, runner, scheduler):
        importlib.import_module(name)
    from vllm.platforms import current_platform

    st = sys.modules["vllm_hsfix"].status()
    return {
        "by": early["activated_by"],
        "vllm": early["vllm"],
        "early": {k: v["code"] for k, v in early["patches"].items()},
        "codes": {k: v["code"] for k, v in st["patches"].items()},
        "cpu_runner_imported": "vllm.v1.worker.cpu_model_runner" in sys.modules,
        "platform": type(current_platform).__name__,
    }


def cuda_untouched() -> bool:
    """Whether activation, the plugin and ``status`` initialised CUDA."""
    import torch

    import _vllm_hsfix_plugin
    import vllm_hsfix

    _vllm_hsfix_plugin.register()
    vllm_hsfix.apply()
    vllm_hsfix.status()
    return torch.cuda.is_initialized()


if __name__ == "__main__":
    result = main(globals())
    if result is not None:
        print(json.dumps(result))
