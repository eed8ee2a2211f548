"""``vllm-hsfix verify``: import each target this build concerns and run its patch's
``verify`` on the live code; rows not needed or turned off are listed as skipped.
"""

from __future__ import annotations

import importlib
import traceback
from typing import Any

from . import checks, hazards, runtime
from .codes import FAILED, REFUSED, Code
from .patches import PATCHES

# Decisions under which a patch's target is not checked here.
SKIP_CODES = {Code.NOT_NEEDED, Code.DISABLED, Code.NO_VLLM}


def origin(exc: BaseException) -> str:
    """Where an exception was raised: ``file.py:LINE in function`` of its last frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "?"


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
    results: list[dict[str, Any]] = []
    for patch in PATCHES:
        rec = runtime.status()["patches"][patch.id]
        why = None
        if not patch.runs_on(inst.cpu_build):
            # Its target never runs on this build (fixed upstream or not): nothing to check.
            why = f"{patch.id}: concerns {patch.platform} builds only: {patch.other_platforms}"
        elif rec["code"] in SKIP_CODES:
            why = f"{patch.id}: {rec['code']}: {rec['reason']}"
        if why is not None:
            results.append(checks.result(patch.id, [], skipped=why))
            continue
        try:
            module = importlib.import_module(patch.module)
        except Exception as exc:
            report["error"] = (
                f"cannot import vLLM's target {patch.module}: {exc!r} (raised at {origin(exc)})"
            )
            return 2, report
        rec = runtime.status()["patches"][patch.id]  # decided on that import
        ctx = checks.Context(device=device, version=inst.version, shape=rec["shape"])
        results += [{"patch": patch.id, **r} for r in patch.implementation().verify(module, ctx)]
    st = runtime.status()
    report["patches"] = {
        k: {"status": v["status"], "reason": v["reason"]} for k, v in st["patches"].items()
    }
    report["checks"] = results
    codes = {k: v["code"] for k, v in st["patches"].items()}
    report["hazards"] = hazards.assess_all(inst.release, codes, st["enabled"], inst.cpu_build)
    bad_patch = [k for k, v in st["patches"].items() if v["status"] in (REFUSED, FAILED)]
    if bad_patch:
        report["error"] = f"patches not in place: {bad_patch}"
    report["ok"] = all(c["ok"] for c in results) and not bad_patch
    return (0 if report["ok"] else 1), report
