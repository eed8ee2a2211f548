"""``vllm-hsfix ARGS`` (``python -m vllm_hsfix``) run in a fresh interpreter, as a user runs
it, and a copy of the checkout to build from."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from conftest import ROOT, clean_env, run


def cli(
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float | None = 300,
    cwd: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """``vllm-hsfix ARGS`` with ``env`` (default: ``clean_env()``), output captured."""
    return run([sys.executable, "-m", "vllm_hsfix", *args], env or clean_env(), timeout, cwd)


def repair(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``vllm-hsfix repair ARGS`` in a scratch directory (its journal and state go to the
    current directory), with a user's environment by default."""
    with tempfile.TemporaryDirectory() as cwd:
        return cli(
            "repair",
            *args,
            env=env or clean_env(VLLM_CPU_KVCACHE_SPACE=None),
            timeout=timeout,
            cwd=cwd,
        )


def checkout_copy(dest: Path) -> Path:
    """A copy in ``dest`` of the files git tracks or would add (no stale ``build/``)."""
    listed = run(["git", "-C", ROOT, "ls-files", "-co", "--exclude-standard"], dict(os.environ))
    assert listed.returncode == 0, listed.stderr
    for name in listed.stdout.split():
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def build_release(dest: Path) -> dict[str, Path]:
    """``python -m build`` of a checkout copy, as docs/releasing.md builds a release: the
    sdist, then the wheel from the sdist, with this environment's locked setuptools."""
    src, out = checkout_copy(dest / "src"), dest / "dist"
    cmd = [sys.executable, "-m", "build", "--no-isolation", "--outdir", out, src]
    proc = run(cmd, dict(os.environ), 600, cwd=dest)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return {"wheel": next(out.glob("vllm_hsfix-*.whl")), "sdist": next(out.glob("*.tar.gz"))}
