"""``vllm-hsfix verify``: import vLLM, activate, and run the checks on the live code.

The checks themselves live in ``checks``; this module only decides which apply to
the installed release and on which device, and builds the report. Exit codes: 0
verified, 1 a check failed or a patch is not in place, 2 it cannot run here.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import checks, runtime


def run(device: str = "auto") -> tuple[int, dict[str, Any]]:
    report: dict[str, Any] = {"ok": False, "device": device, "checks": []}
    inst = runtime.install()
    report["vllm"] = inst.as_dict()
    if not inst.present:
        report["error"] = "vLLM is not installed in this environment: nothing to verify"
        return 2, report
    try:
        import torch
    except ImportError as exc:
        report["error"] = f"torch cannot be imported: {exc}"
        return 2, report
    has_cuda = torch.cuda.is_available()
    if device == "auto":
        device = "cuda" if has_cuda else "cpu"
    if device == "cuda" and not has_cuda:
        report["error"] = "--device cuda: no CUDA GPU is available on this machine"
        return 2, report
    report["device"] = device
    runtime.start("verify")
    try:
        model = importlib.import_module(checks.MODEL_MODULE)
        importlib.import_module(checks.CONNECTOR_MODULE)
    except Exception as exc:
        report["error"] = f"cannot import vLLM's targets: {exc!r}"
        return 2, report
    st = runtime.status()
    report["patches"] = {
        k: {"status": v["status"], "reason": v["reason"]} for k, v in st["patches"].items()
    }
    fn = checks.live_scatter(model, inst.version)
    results = checks.scatter_checks(fn, device, st["patches"]["scatter-clamp"]["shape"])
    if device == "cuda":
        results += checks.cuda_checks(fn)
    results += checks.connector_checks(inst.version)
    report["checks"] = results
    bad_patch = [k for k, v in st["patches"].items() if v["status"] in ("refused", "failed")]
    if bad_patch:
        report["error"] = f"patches not in place: {bad_patch}"
    report["ok"] = all(c["ok"] for c in results) and not bad_patch
    return (0 if report["ok"] else 1), report
