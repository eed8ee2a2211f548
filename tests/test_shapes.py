"""The shape gates on synthetic code, and fingerprints that do not depend on the Python
version. Static: no torch, no vLLM import (runs on Python 3.10-3.13)."""

from __future__ import annotations

import ast
import json
import os
import textwrap
from pathlib import Path

import pytest

from vllm_hsfix import shapes
from vllm_hsfix.patches import PATCHES, scatter

SIGNATURE = "def basic_cache(to_cache, kv_cache, slot_mapping):\n"


def probe(body: str) -> shapes.Probe:
    return scatter.probe_tree(ast.parse(SIGNATURE + textwrap.indent(textwrap.dedent(body), "    ")))


def test_the_known_scatter_shapes_are_recognised_whatever_the_names() -> None:
    flat = probe(
        """
        nb, bs, h, d = kv_cache.shape
        cache2 = kv_cache.view(nb * bs, h, d)
        cache2[slot_mapping] = to_cache
        """
    )
    two_d = probe(
        """
        size = kv_cache.shape[1]  # renamed local, comment
        kv_cache[slot_mapping // size, slot_mapping % size] = to_cache
        """
    )
    fixed = probe(
        """
        size = kv_cache.shape[1]
        slot_mapping = slot_mapping.clamp_min(0)
        kv_cache[slot_mapping // size, slot_mapping % size] = to_cache
        """
    )
    assert (flat.shape, two_d.shape, fixed.shape, fixed.fixed) == (
        "flat-view",
        "2d-index",
        None,
        True,
    )


@pytest.mark.parametrize(
    ("what", "body"),
    [
        (
            "head-major store (0.29+ layout) without the clamp",
            """
            bs = kv_cache.shape[2]
            kv_cache[slot_mapping // bs, :, slot_mapping % bs] = to_cache
            """,
        ),
        (
            "operands swapped",
            """
            bs = kv_cache.shape[1]
            kv_cache[slot_mapping % bs, slot_mapping // bs] = to_cache
            """,
        ),
        (
            "block size from another axis",
            """
            bs = kv_cache.shape[2]
            kv_cache[slot_mapping // bs, slot_mapping % bs] = to_cache
            """,
        ),
        (
            "a debug assert on slot_mapping is not a clamp",
            """
            assert (slot_mapping >= -1).all()
            bs = kv_cache.shape[1]
            kv_cache[slot_mapping // bs, slot_mapping % bs] = to_cache
            """,
        ),
        (
            "a comparison that filters instead of clamping",
            """
            bs = kv_cache.shape[1]
            keep = slot_mapping >= 0
            kv_cache[slot_mapping[keep] // bs, slot_mapping[keep] % bs] = to_cache[keep]
            """,
        ),
        (
            "a clamp that does not feed the store",
            """
            bs = kv_cache.shape[1]
            clamped = slot_mapping.clamp_min(0)
            kv_cache[slot_mapping // bs, slot_mapping % bs] = to_cache
            """,
        ),
    ],
)
def test_anything_else_is_refused(what: str, body: str) -> None:
    result = probe(body)
    assert not result.known, what
    assert "none of the known stores" in result.detail


def test_the_replacement_follows_the_recognised_shape() -> None:
    # Each shape gets the scatter written for it; there is no generic fallback.
    assert set(scatter.REPLACEMENTS) == set(scatter.SHAPES.values())
    assert scatter.REPLACEMENTS["flat-view"] is scatter.scatter_flat
    assert scatter.REPLACEMENTS["2d-index"] is scatter.scatter_clamped


def test_canonical_form_drops_what_python_versions_disagree_on() -> None:
    a = ast.parse("def f(x: int) -> None:\n    '''doc'''\n    return x.y[1]\n").body[0]
    b = ast.parse("def f(x:int)->None:\n    return x.y[1]  # comment\n").body[0]
    assert shapes.fingerprint(a) == shapes.fingerprint(b)
    text = shapes.canonical(a)
    assert "ctx=" not in text and "type_params" not in text and "kind=" not in text


def _overlays() -> list[Path]:
    raw = os.environ.get("VLLM_HSFIX_OVERLAYS", "")
    return [Path(p) for p in raw.split(os.pathsep) if p and (Path(p) / "vllm").is_dir()]


def test_fingerprints_of_every_unpacked_release_match_the_tested_table() -> None:
    """tested.json was written on one Python; every Python must compute the same."""
    overlays = _overlays()
    if not overlays:
        pytest.skip("VLLM_HSFIX_OVERLAYS names no unpacked vLLM (set by scripts/run_tests.py)")
    table = json.loads((Path(shapes.__file__).parent / "tested.json").read_text())["releases"]
    checked = 0
    for overlay in overlays:
        release = overlay.name.removeprefix("vllm-")
        if release not in table:
            continue
        for patch in PATCHES:
            path = overlay.joinpath(*patch.module.split(".")).with_suffix(".py")
            if not path.exists():
                continue
            got = shapes.probe_file(str(path), patch.implementation().probe_tree)
            assert got.fingerprints == table[release]["fingerprints"][patch.id], (release, patch.id)
            want_shape = table[release]["shapes"][patch.id]
            assert ("fixed" if got.fixed else got.shape) == want_shape, (release, patch.id)
            checked += 1
    assert checked >= len(overlays), checked


def test_status_on_every_unpacked_release_says_what_the_tested_table_says() -> None:
    """`vllm-hsfix status` (vLLM not imported) on each unpacked wheel, on this Python."""
    import subprocess
    import sys

    overlays = _overlays()
    if not overlays:
        pytest.skip("VLLM_HSFIX_OVERLAYS names no unpacked vLLM (set by scripts/run_tests.py)")
    root = Path(shapes.__file__).resolve().parent.parent
    table = json.loads((root / "vllm_hsfix" / "tested.json").read_text())["releases"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_HSFIX_")}
    env.pop("VLLM_PLUGINS", None)
    checked = []
    for overlay in overlays:
        release = overlay.name.removeprefix("vllm-")
        if release not in table:
            continue
        env["PYTHONPATH"] = f"{root}{os.pathsep}{overlay}"
        out = subprocess.run(
            [sys.executable, "-m", "vllm_hsfix", "status", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        report = json.loads(out.stdout)
        want = {
            pid: ("would-apply" if code == "apply" else code)
            for pid, code in table[release]["expected"].items()
        }
        got = {pid: p["code"] for pid, p in report["patches"].items()}
        assert report["vllm"]["release"] == release
        assert got == want, (release, got, want)
        assert report["tested_build"]["tested"] is True, (release, report["tested_build"])
        checked.append(release)
    assert checked, "no overlay of a tested release"
