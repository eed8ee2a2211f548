"""``repair`` refuses to make the same mistake twice.

Regenerating with a vLLM that still has the bug writes wrong files again, over the
ones being repaired. So, before anything is written, twice:

1. :func:`preflight`, before vLLM starts: ``vllm-hsfix status --json`` in a fresh
   interpreter with this environment, the check an image build runs. Any problem
   (a patch refused, disabled, an unknown build, the plugin filtered out by
   ``VLLM_PLUGINS``, no vLLM) stops the repair.
2. :func:`in_engine`, after vLLM started and before the first request: the status
   files (``VLLM_HSFIX_STATUS_DIR``) of the processes that run the model (the engine
   core, the workers). Every patch the preflight expected to apply must be applied in
   one of them and refused, failed or reverted in none, and the in-situ check, where
   it ran, must have passed. A process without a status file did not load vllm-hsfix.
   A patch of one family of models (``PatchSpec.models``) may also stay on-import: the
   verifier is of another family and never imports its target.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..codes import APPLIED, FAILED, ON_IMPORT, REFUSED, REVERTED, Code

BAD_STATUSES = frozenset({REFUSED, FAILED, REVERTED})
FRONT_END = "vllm.entrypoints.cli."


def preflight(env: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    """(problems, patches that must be applied in the engine)."""
    out = subprocess.run(
        [sys.executable, "-m", "vllm_hsfix", "status", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    try:
        report: dict[str, Any] = json.loads(out.stdout)
    except ValueError:
        return [f"vllm-hsfix status failed (exit {out.returncode}): {out.stderr[-500:]}"], []
    problems = list(report.get("problems") or [])
    needed = [
        pid
        for pid, p in report.get("patches", {}).items()
        if p["code"] == Code.APPLY and not _front_end_only(pid)
    ]
    return problems, needed


def _front_end_only(patch_id: str) -> bool:
    """A patch of vLLM's command line (``vllm serve``'s entry point): the engine core
    and the workers never import its target, so it is not theirs to have applied."""
    from ..patches import PATCHES

    return any(p.id == patch_id and p.module.startswith(FRONT_END) for p in PATCHES)


def _model_processes(statuses: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The processes that run the model: where the in-situ check ran, else by role."""
    ran = [s for s in statuses if s.get("verify") is not None]
    if ran:
        return ran
    return [s for s in statuses if s["role"] == "engine-core" or s["role"].startswith("worker")]


def read_statuses(status_dir: str) -> list[dict[str, Any]]:
    out = []
    for f in sorted(Path(status_dir).glob("*.json")):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    return out


def in_engine(status_dir: str, needed: list[str], in_process: bool = False) -> list[str]:
    """Problems found in the running engine's processes (see the module docstring).
    ``in_process``: the model runs in this very process (its status is the main one)."""
    statuses = read_statuses(status_dir)
    procs = (
        [s for s in statuses if s["pid"] == os.getpid()]
        if in_process
        else _model_processes(statuses)
    )
    if not procs:
        return [
            "no process of the vLLM engine reported vllm-hsfix's status: vllm-hsfix is not "
            "active where the model runs (is its vllm.general_plugins entry point filtered?)"
        ]
    from ..patches import by_id

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
