"""The harness's own plugin for vLLM runs on a CPU machine: a measurement, no stand-in.

Test and demo harness only: never imported by the patches users get. It is copied as
the top-level module ``hsfix_cpu_standins`` into a plugin directory that carries its
own ``vllm.general_plugins`` entry point, so vLLM loads it in every process it starts
(workers included) without importing vllm_hsfix.

What let vLLM's CPU build extract at all used to live here (CUDA stream, event and
pinned-copy stand-ins for the connector, the 0.24.0 sampler keyword); vllm-hsfix
fixes both now (``cpu-connector-save``, ``cpu-sampler-fp64-flag``), so the runs go
through the product's code, as a user's would. What is left is a measurement, not a
stand-in: a record of the block sizes the worker reads with (``HSFIX_DEMO_OBSERVE_DIR``),
for the demo's table, and of each process's file writes; neither changes the run. On
a CPU with AMX the runs take vLLM's AMX kernels, as a user's do
(``cpu-gdn-wide-conv-state`` lets the gated-delta-net layers run there with a
speculative method).

The tests' experiment switches (a worker killed mid-start, vLLM's CPU block zeroing
made a no-op) are a plugin of the tests (``tests/support/experiments.py``), not of
the wheel.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch as _torch

CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"


def install_connector_hooks(module: Any) -> None:
    """The block-size record, on the connector class."""
    observe_dir = os.environ.get("HSFIX_DEMO_OBSERVE_DIR")
    cls = getattr(module, "ExampleHiddenStatesConnector", None)
    if observe_dir and cls is not None:
        import wrapt

        def observe(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            # Harness-only record of the block sizes the worker reads with.
            try:
                return wrapped(*args, **kwargs)
            finally:
                buf = getattr(instance, "_kv_cache", None)
                seen = {
                    "pid": os.getpid(),
                    "connector_block_size": getattr(instance, "_block_size", None),
                    "buffer_block_size": int(buf.shape[1]) if buf is not None else None,
                    "group": getattr(instance, "_hs_group_idx", None),
                }
                os.makedirs(observe_dir, exist_ok=True)
                with open(os.path.join(observe_dir, f"{os.getpid()}.json"), "w") as fh:
                    json.dump(seen, fh)

        wrapt.wrap_function_wrapper(cls, "register_kv_caches", observe)
    if observe_dir and callable(getattr(module, "save_file", None)):
        import wrapt

        def record(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
            # Harness-only record of who writes each file (one writer per file).
            os.makedirs(observe_dir, exist_ok=True)
            with open(os.path.join(observe_dir, f"writes-{os.getpid()}.jsonl"), "a") as fh:
                fh.write(json.dumps({"pid": os.getpid(), "path": str(args[1])}) + "\n")
            return wrapped(*args, **kwargs)

        wrapt.wrap_function_wrapper(module, "save_file", record)


def register() -> None:
    """``vllm.general_plugins`` entry point of the harness (CPU machines only)."""
    if _torch.cuda.is_available():
        return
    import wrapt

    wrapt.register_post_import_hook(install_connector_hooks, CONNECTOR_MODULE)


def write_plugin_dir(path: str) -> str:
    """Lay out an importable copy of this module with its own entry point; return ``path``."""
    os.makedirs(path, exist_ok=True)
    with open(__file__, encoding="utf-8") as src:
        code = src.read()
    with open(os.path.join(path, "hsfix_cpu_standins.py"), "w", encoding="utf-8") as dst:
        dst.write(code)
    info = os.path.join(path, "hsfix_cpu_standins-0.0.0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as fh:
        fh.write("Metadata-Version: 2.1\nName: hsfix-cpu-standins\nVersion: 0.0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as fh:
        fh.write("[vllm.general_plugins]\nhsfix_cpu_standins = hsfix_cpu_standins:register\n")
    return path
