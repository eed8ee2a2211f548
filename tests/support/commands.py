"""``vllm-hsfix ARGS`` (``python -m vllm_hsfix``) run in a fresh interpreter, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
import tempfile

from conftest import clean_env


def cli(
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float | None = 300,
    cwd: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """``vllm-hsfix ARGS`` with ``env`` (default: ``clean_env()``), output captured."""
    return subprocess.run(
        [sys.executable, "-m", "vllm_hsfix", *args],
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def repair(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``vllm-hsfix repair ARGS`` in a scratch directory of its own (the default journal
    and audit state are written to the current directory), with a user's environment by
    default: no ``VLLM_CPU_KVCACHE_SPACE``."""
    with tempfile.TemporaryDirectory() as cwd:
        return cli(
            "repair",
            *args,
            env=env or clean_env(VLLM_CPU_KVCACHE_SPACE=None),
            timeout=timeout,
            cwd=cwd,
        )
