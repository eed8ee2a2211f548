"""Experiment switches for vLLM runs in tests, a ``vllm.general_plugins`` entry point laid
out by :func:`env`: ``HSFIX_EXPERIMENT_KILL_WORKER=1`` (the worker SIGKILLs itself when it
registers the KV caches); ``HSFIX_EXPERIMENT_KILL_AT=ROLE:FLAG`` (``front-end`` or
``engine-core`` waits at its first step until ``FLAG`` exists, then SIGKILLs itself)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
# Where each role of HSFIX_EXPERIMENT_KILL_AT steps: (module, class, methods).
STEPS = {
    "front-end": ("vllm.v1.engine.llm_engine", "LLMEngine", ("step",)),
    "engine-core": ("vllm.v1.engine.core", "EngineCore", ("step", "step_with_batch_queue")),
}
NAME = "hsfix_experiments"


def _kill_worker(module: Any) -> None:
    import signal

    def die(*args: Any, **kwargs: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    module.ExampleHiddenStatesConnector.register_kv_caches = die


def _kill_at_step(cls_name: str, methods: tuple[str, ...], flag: str) -> Any:
    """A post-import hook: ``cls_name``'s ``methods`` wait for ``flag``, then SIGKILL us."""
    import signal
    import time

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        while not os.path.exists(flag):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)

    def hook(module: Any) -> None:
        cls = getattr(module, cls_name)
        for name in methods:
            if hasattr(cls, name):
                setattr(cls, name, step)

    return hook


def register() -> None:
    """The plugin's entry point: install the switches that are set."""
    import wrapt

    if os.environ.get("HSFIX_EXPERIMENT_KILL_WORKER") == "1":
        wrapt.register_post_import_hook(_kill_worker, CONNECTOR_MODULE)
    role, _, flag = os.environ.get("HSFIX_EXPERIMENT_KILL_AT", "").partition(":")
    if role in STEPS:
        module, cls_name, methods = STEPS[role]
        wrapt.register_post_import_hook(_kill_at_step(cls_name, methods, flag), module)


def env(root: Path, **switches: str) -> dict[str, str]:
    """Environment additions for a run with ``switches``: the plugin directory (on
    ``PYTHONPATH``, with its entry point) and the switches themselves."""
    where = root / "experiments-plugin"
    where.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(__file__, where / f"{NAME}.py")
    info = where / f"{NAME}-0.0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {NAME}\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{NAME} = {NAME}:register\n")
    return {"PYTHONPATH": str(where), **switches}
