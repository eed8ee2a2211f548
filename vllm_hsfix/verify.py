"""``vllm-hsfix verify``: import each target this build concerns and run its patch's
``verify`` on the live code; rows not needed or turned off are listed as skipped.
"""

from __future__ import annotations

import importlib
import traceback
from typing import Any

from . import checks, hazards, runtime, views
from .codes import Code
from .errors import HsfixError
from .patches import PATCHES

# Decisions under which a patch's target is not checked here.
SKIP_CODES = {Code.NOT_NEEDED, Code.DISABLED, Code.NO_VLLM}


def origin(exc: BaseException) -> str:
    """Where an exception was raised: ``file.py:LINE in function`` of its last frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "?"


def run(device: str = "auto") -> tuple[int, dict[str, Any]]:
    out: dict[str, Any] = {"ok": False, "device": device, "checks": []}
    inst = runtime.install()
    out["vllm"] = inst.as_dict()
    if not inst.present:
        out["error"] = "vLLM is not installed in this environment: nothing to verify"
        return 2, out
    try:
        import torch
    except ImportError as exc:
        out["error"] = f"torch cannot be imported: {exc}"
        return 2, out
    has_cuda = torch.cuda.is_available()
    if device == "auto":
        device = "cuda" if has_cuda else "cpu"
    if device == "cuda" and not has_cuda:
        out["error"] = "--device cuda: no CUDA GPU is available on this machine"
        return 2, out
    out["device"] = device
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
        if why is not None:  # a needed row turned off fails (views.not_in_place)
            missing = views.not_in_place({patch.id: rec})
            skipped = {} if missing else {"skipped": why}
            results.append(checks.result(patch.id, missing, **skipped))
            continue
        try:
            module = importlib.import_module(patch.module)
        except HsfixError:  # strict mode refuses the import: the policy below says why
            break
        except Exception as exc:
            out["error"] = (
                f"cannot import vLLM's target {patch.module}: {exc!r} (raised at {origin(exc)})"
            )
            return 2, out
        rec = runtime.status()["patches"][patch.id]  # decided on that import
        ctx = checks.Context(device=device, version=inst.version, shape=rec["shape"])
        results += [{"patch": patch.id, **r} for r in patch.implementation().verify(module, ctx)]
    return _verdict(out, results)


def _verdict(out: dict[str, Any], results: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """The checks' results, the patches and hazards as they stand, and the exit code:
    1 when a check failed or a row the release needs is not in place."""
    st = runtime.status()
    out["patches"] = st["patches"]  # the one entry schema (views.entry)
    out["checks"] = results
    codes = {k: v["code"] for k, v in st["patches"].items()}
    v = st["vllm"]
    out["hazards"] = hazards.assess_all(v["release"], codes, v["cpu_build"], hazards.cpu_has_amx())
    bad = st["problems"]
    if bad:
        out["error"] = "the fix is not in place: " + "; ".join(bad)
    out["ok"] = all(c["ok"] for c in results) and not bad
    return (0 if out["ok"] else 1), out
