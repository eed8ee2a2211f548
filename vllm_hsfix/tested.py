"""Releases this version of vllm-hsfix was tested on, and their target fingerprints.

``tested.json`` is data written by ``scripts/fingerprints.py`` from the real wheels
and checked by the release-matrix tests: if a build's targets hash differently from
the tested release (a vendor build, a new patch release), ``status`` says
"untested build" even when the shape gate still recognises the code.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .detect import VllmInstall


@lru_cache(maxsize=1)
def table() -> dict[str, Any]:
    text = resources.files(__package__).joinpath("tested.json").read_text()
    return json.loads(text)


def describe(inst: VllmInstall, fingerprints: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Whether this build's fingerprints (per patch id) match those of the tested release."""
    if not inst.present or inst.release is None:
        return {"tested": False, "reason": "no vLLM release identified"}
    entry = table().get("releases", {}).get(inst.release)
    if entry is None:
        return {"tested": False, "reason": f"vLLM {inst.release} is not a tested release"}
    mismatches = []
    for patch_id, got_fps in fingerprints.items():
        want = entry.get("fingerprints", {}).get(patch_id, {})
        for name, got in got_fps.items():
            if name in want and want[name] != got:
                mismatches.append(f"{patch_id}:{name} {got} != tested {want[name]}")
    if mismatches:
        return {
            "tested": False,
            "reason": f"untested build of {inst.release}: " + "; ".join(mismatches),
        }
    checked = any(fingerprints.values())
    return {
        "tested": True,
        "reason": f"vLLM {inst.release} is a tested release"
        + ("; target fingerprints match" if checked else ""),
        "expected": entry.get("expected", {}),
    }
