"""``vllm-hsfix audit`` in a process of its own, no torch, no vLLM (test_audit_cli.py).

``audit_runs.py CASE ARG``: ``standalone DIR`` audits DIR with two workers and prints
the exit code, whether numpy stayed out of the import and which heavy modules came in;
``peaks FILE`` prints the process's peak memory before and after auditing FILE, and
after reading a whole-file mapping of it (the control), with the verdict and the
per-layer counts; ``without_numpy DIR`` runs the CLI as if numpy were not installed
and exits with its code."""

from __future__ import annotations

import json
import resource
import sys
from typing import Any

from support.children import main


def standalone(folder: str) -> list[Any]:
    from vllm_hsfix.audit.command import main as audit

    light = "numpy" not in sys.modules
    code = audit([folder, "--workers", "2"])
    heavy = sorted(m for m in ("torch", "vllm", "safetensors") if m in sys.modules)
    return [code, light, heavy]


def peak() -> int:
    """Peak RSS of this process. On Linux getrusage's ru_maxrss also carries the peak of
    the process that forked us (pytest, with torch loaded) across exec, so the
    per-address-space VmHWM is read where it exists."""
    try:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peaks(path: str) -> list[Any]:
    import numpy as np

    from vllm_hsfix.audit.scan import audit_file

    base = peak()
    rep = audit_file(path)
    audited = peak()
    # Control: the same measurement does see a whole-file mapping being read.
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    int(mm[::4096].sum())
    return [base, audited, peak(), rep.verdict, [s.count for s in rep.layers]]


def without_numpy(folder: str) -> None:
    sys.modules["numpy"] = None  # type: ignore[assignment]  # as if not installed
    from vllm_hsfix.cli import main as cli

    sys.exit(cli(["audit", folder]))


if __name__ == "__main__":
    print(json.dumps(main(globals())))
