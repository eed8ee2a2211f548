"""``vllm-hsfix audit`` in a process of its own: ``audit_runs.py CASE ARG ...`` prints the
case's result as JSON; ``without MODULE ARGV ...`` runs the CLI as if MODULE were missing."""

from __future__ import annotations

import json
import resource
import sys
from typing import Any

from support.children import main


def standalone(folder: str) -> list[Any]:
    """Exit code of auditing ``folder`` with two workers, whether numpy stayed out of
    the import, and which heavy modules came in."""
    from vllm_hsfix.audit.command import main as audit

    light = "numpy" not in sys.modules
    code = audit([folder, "--workers", "2"])
    heavy = sorted(m for m in ("torch", "vllm", "safetensors") if m in sys.modules)
    return [code, light, heavy]


def peak() -> int:
    """Peak RSS of this process: VmHWM where it exists, since ru_maxrss also carries the
    peak of the process that forked us across exec."""
    try:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peaks(path: str) -> list[Any]:
    """Peak memory before and after auditing ``path``, and after reading a whole-file
    mapping of it (the control); the verdict and the per-layer counts."""
    import numpy as np

    from vllm_hsfix.audit.scan import audit_file

    base = peak()
    rep = audit_file(path)
    audited = peak()
    # Control: the same measurement does see a whole-file mapping being read.
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    int(mm[::4096].sum())
    return [base, audited, peak(), rep.verdict, [s.count for s in rep.layers]]


def without(module: str, *argv: str) -> None:
    sys.modules[module] = None  # type: ignore[assignment]  # as if not installed
    from vllm_hsfix.cli import main as cli

    sys.exit(cli(list(argv)))


def kernel_enabled(total: str) -> bool:
    from vllm_hsfix.audit import decode

    return decode.enable(int(total))


def kernel_loads(*paths: str) -> list[list[Any]]:
    """Each file audited in turn past ``MIN_BYTES``: its verdict, whether numba is
    imported after it, and whether the kernel is loaded."""
    from vllm_hsfix.audit import decode, parallel

    out = []
    for path in paths:
        (rep,) = parallel.run_batch([path], decode.MIN_BYTES)
        out.append([rep.verdict, "numba" in sys.modules, bool(decode._kernel)])
    return out


def blas_threads() -> dict[str, Any]:
    """BLAS threads before, inside and after ``prefix.single_blas_thread``, torch's loaded late."""
    from threadpoolctl import threadpool_info

    from vllm_hsfix.audit import prefix

    def blas() -> list[int]:
        return [x["num_threads"] for x in threadpool_info() if x["user_api"] == "blas"]

    with prefix.single_blas_thread():
        pass
    import torch  # noqa: F401  (its BLAS is loaded now, after the first batch)

    before = blas()
    with prefix.single_blas_thread() as on:
        inside = blas()
    return {"on": on, "before": before, "inside": inside, "after": blas()}


if __name__ == "__main__":
    print(json.dumps(main(globals())))
