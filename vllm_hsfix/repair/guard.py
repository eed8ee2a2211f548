"""``repair`` refuses to write wrong files again: the fix must be active, checked twice:
before vLLM starts (:func:`preflight`) and in the processes that run the model, before
the first request (:func:`in_engine`)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..codes import APPLIED, FAILED, ON_IMPORT, REFUSED, REVERTED, Code
from ..patches import PATCHES, by_id

BAD_STATUSES = frozenset({REFUSED, FAILED, REVERTED})
FRONT_END = "vllm.entrypoints.cli."  # vLLM's command line: never imported by the engine


def preflight() -> tuple[list[str], list[str]]:
    """(problems, patches that must be applied in the engine), from ``vllm-hsfix status``
    of this environment."""
    cmd = [sys.executable, "-m", "vllm_hsfix", "status", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    try:
        report: dict[str, Any] = json.loads(out.stdout)
    except ValueError:
        return [f"vllm-hsfix status failed (exit {out.returncode}): {out.stderr[-500:]}"], []
    front_end = {p.id for p in PATCHES if p.module.startswith(FRONT_END)}
    needed = [
        pid
        for pid, p in report.get("patches", {}).items()
        if p["code"] == Code.APPLY and pid not in front_end
    ]
    return list(report.get("problems") or []), needed


def in_engine(status_dir: str, needed: list[str]) -> list[str]:
    """Problems in the engine's processes (their ``VLLM_HSFIX_STATUS_DIR`` files): a needed
    patch not applied (one of another family of models may stay on-import) or the in-situ
    check failed."""
    statuses = []
    for f in sorted(Path(status_dir).glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            statuses.append(json.loads(f.read_text()))
    procs = [s for s in statuses if s.get("verify") is not None] or [
        s for s in statuses if s["role"] == "engine-core" or s["role"].startswith("worker")
    ]
    if not procs:
        return [
            "no process of the vLLM engine reported vllm-hsfix's status: vllm-hsfix is not "
            "active where the model runs (is its vllm.general_plugins entry point filtered?)"
        ]
    problems = []
    for pid in needed:
        seen = {s["role"]: s["patches"].get(pid, {}).get("status") for s in procs}
        bad = {role: st for role, st in seen.items() if st in BAD_STATUSES}
        other_model = by_id(pid).models and set(seen.values()) == {ON_IMPORT}
        if bad:
            problems.append(f"{pid} is {bad} in the engine")
        elif APPLIED not in seen.values() and not other_model:
            problems.append(f"{pid} is not applied in the engine's processes ({seen})")
    for s in procs:
        check = s.get("verify")
        if check is not None and not check.get("ok"):
            problems.append(f"in-situ check failed in {s['role']}: {check.get('problems')}")
    return problems
