"""The shape gates on synthetic code, and fingerprints that do not depend on the Python
version. Static: no torch, no vLLM import (runs on Python 3.10-3.13)."""

from __future__ import annotations

import ast
import json
import textwrap
from pathlib import Path

import pytest
from support import skeletons as sk
from support.digest import digest

from vllm_hsfix import shapes
from vllm_hsfix.patches import PATCHES
from vllm_hsfix.patches.scatter_clamp import fix as scatter

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
    assert result.shape is None and not result.fixed, what
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


def test_tested_code_is_decided_by_fingerprint_other_code_by_the_shape_check() -> None:
    """A tested build's ``basic_cache`` gets its recorded answer; the same code renamed is
    decided by the shape check, which names it code of no tested build."""
    trees = sk.trees(sk.CPU)
    if not trees:
        pytest.skip("VLLM_HSFIX_OVERLAYS names no unpacked vLLM (set by scripts/run_tests.py)")
    renamed = 0
    for _release, tree, entry in trees:
        src = (tree / "vllm/model_executor/models/extract_hidden_states.py").read_text()
        known = scatter.probe_tree(ast.parse(src))
        assert known.detail.startswith("the code of tested build "), known
        assert ("fixed" if known.fixed else known.shape) == entry["shapes"]["scatter-clamp"]
        body = "    block_size = kv_cache.shape"
        if body not in src:
            continue  # 0.17-0.21 unpack the shape: no such local
        other = scatter.probe_tree(
            ast.parse(
                src.replace(body, "    bs = kv_cache.shape")
                .replace("% block_size", "% bs")
                .replace("// block_size", "// bs")
            )
        )
        assert other.detail.startswith("code of no tested build; "), other
        assert other.fingerprints != known.fingerprints
        assert (other.shape, other.fixed) == (known.shape, known.fixed)
        renamed += 1
    assert renamed, "no overlay of 0.22+ here"


# Each patch's shape per release, stated from the releases' code independently of
# tested.json: from which release on each line holds (None: a shape it does not know).
STATED_SHAPES = {
    "scatter-clamp": {"0.17.0": "flat-view", "0.22.0": "2d-index", "0.25.0": "fixed"},
    "hidden-group-block-size": {"0.17.0": None, "0.24.0": "0.24-worker-rebuild", "0.25.0": "fixed"},
    "aux-final-layer": {"0.17.0": None, "0.18.0": "pre-norm-capture", "0.25.0": "fixed"},
    "cpu-zero-blocks": {"0.17.0": None, "0.19.0": "no-op", "0.25.0": "fixed"},
    "abort-before-scheduling": {"0.17.0": None, "0.24.0": "pop-without-default", "0.31.0": "fixed"},
    "cpu-connector-save": {
        "0.17.0": "fixed",
        "0.22.0": "save-kv-layer",
        "0.24.0": "submit-async-write",
    },
    "cpu-sampler-fp64-flag": {"0.17.0": None, "0.20.0": "keyword-missing", "0.25.0": "fixed"},
    "cpu-gdn-wide-conv-state": {"0.17.0": None, "0.22.0": "narrow-state-kernels", "0.26.0": None},
    "atomic-writes": {"0.17.0": None, "0.22.0": "write-in-place"},
    "cpu-dist-name": {"0.17.0": "version-of-vllm"},
    # issue 54 rows, read from the connector, scheduler and proposer of each release
    "slots-from-blocks": {"0.17.0": "fixed", "0.22.0": "step-sliced", "0.24.0": "fixed"},
    "allow-chunked-prefill": {
        "0.17.0": "fixed",
        "0.22.0": "refuses-chunked-prefill",
        "0.24.0": "fixed",
    },
    "atomic-writes-in-step": {"0.17.0": "save-file-in-step", "0.22.0": "fixed"},
    "tp-rank-zero-writes": {"0.17.0": "every-rank-saves", "0.24.0": "fixed"},
    "drafter-skip-guard": {"0.17.0": "fixed", "0.25.0": "pad-to-max-model-len", "0.29.0": "fixed"},
    "next-token-last-valid": {"0.17.0": "first-column"},
    # issue 57 rows
    "nested-text-config": {"0.17.0": "flattened", "0.20.0": "fixed"},
    "hidden-cache-dtype": {"0.17.0": "asserts-cache-dtype", "0.20.0": "fixed"},
    "draft-column": {"0.17.0": "unsqueezed", "0.18.0": "whole", "0.20.0": "fixed"},
    "no-new-blocks": {"0.17.0": "asserts-new-blocks", "0.18.0": "fixed"},
}


def _stated_shape(patch_id: str, release: str) -> str | None:
    def key(r: str) -> tuple[int, ...]:
        return tuple(int(x) for x in r.split("."))

    lines = STATED_SHAPES[patch_id]
    return lines[max((r for r in lines if key(r) <= key(release)), key=key)]


def _check_fingerprints(release: str, tree: Path, entry: dict) -> int:
    checked = 0
    for patch in PATCHES:
        path = tree.joinpath(*patch.module.split(".")).with_suffix(".py")
        if not path.exists():
            continue
        impl = patch.implementation()
        got = shapes.probe_file(str(path), impl.probe_tree)
        assert got.fingerprints == entry["fingerprints"][patch.id], (release, patch.id)
        want_shape = entry["shapes"][patch.id]
        assert ("fixed" if got.fixed else got.shape) == want_shape, (release, patch.id)
        # The small shape check, which decides code of no tested build, gives every
        # tested build the answer recorded for it too.
        check = shapes.probe_file(str(path), impl.shape_check)
        assert ("fixed" if check.fixed else check.shape) == want_shape, (release, patch.id)
        assert want_shape == _stated_shape(patch.id, release), (release, patch.id)
        checked += 1
    return checked


@pytest.mark.parametrize("dist", [sk.CPU, sk.CUDA])
def test_fingerprints_of_every_unpacked_build_match_the_tested_table(dist: str) -> None:
    """Every Python computes tested.json's fingerprints for every overlay and skeleton."""
    trees = sk.trees(dist)
    if not trees:
        pytest.skip(f"no unpacked {dist} build named (set by scripts/run_tests.py)")
    checked = sum(_check_fingerprints(*t) for t in trees)
    assert checked >= len(trees), checked


@pytest.mark.parametrize("dist", [sk.CPU, sk.CUDA])
def test_status_on_every_unpacked_build_says_what_the_tested_table_says(dist: str) -> None:
    """``vllm-hsfix status`` on each overlay and CUDA skeleton says the build's distribution,
    release, platform and decisions as tested.json records them."""
    trees = sk.trees(dist)
    if not trees:
        pytest.skip(f"no unpacked {dist} build named (set by scripts/run_tests.py)")
    for release, tree, entry in trees:
        report = json.loads(sk.status(tree, "--json").stdout)
        got = {pid: p["code"] for pid, p in report["patches"].items()}
        assert (report["vllm"]["distribution"], report["vllm"]["release"]) == (dist, release)
        assert report["vllm"].get("cpu_build") is (dist == sk.CPU), (release, report["vllm"])
        assert got == entry["expected"], (release, got)
        tb = report["tested_build"]
        assert tb["tested"] is True and tb.get("build") == f"{dist} {release}", (release, tb)
        if dist == sk.CUDA:
            assert got == sk.stated(release), (release, got)
            zero = report["patches"]["cpu-zero-blocks"]
            if zero["code"] == "not-needed" and release >= "0.22.0":
                assert "GPU workers zero" in zero["reason"], (release, zero["reason"])


def test_the_recorded_cuda_wheels_are_the_ones_pip_picks() -> None:
    """tested.json names the CUDA wheel pip installs on x86-64 (the rebuilt, tagged one where
    PyPI has it), and each skeleton was read from it."""
    rebuilt = {"0.20.1": "1", "0.21.0": "1", "0.23.0": "2"}
    table = sk.builds()
    for release, entry in table.items():
        wheel = entry["builds"][sk.CUDA]["wheel"]
        tag = rebuilt.get(release)
        prefix = f"vllm-{release}-{tag}-cp38-abi3-" if tag else f"vllm-{release}-cp38-abi3-"
        assert wheel.startswith(prefix) and wheel.endswith("_x86_64.whl"), (release, wheel)
    for release, skeleton, entry in sk.trees(sk.CUDA):
        stamp = json.loads((skeleton / ".vllm-hsfix-skeleton").read_text())
        assert stamp["wheel"] == entry["wheel"], release


def fingerprints_shared() -> set[str]:
    """The target files of every patch that concerns any platform, from the table."""
    from vllm_hsfix.patches import ANY

    return {p.module.replace(".", "/") + ".py" for p in PATCHES if p.platform == ANY}


def test_cuda_and_cpu_wheels_have_byte_identical_targets() -> None:
    """The CUDA and CPU wheels' targets are the same bytes, those tested.json recorded."""
    cpu = {release: tree for release, tree, _ in sk.trees(sk.CPU)}
    cuda = sk.trees(sk.CUDA)
    if not cuda:
        pytest.skip("VLLM_HSFIX_CUDA_SKELETONS names no skeleton (set by scripts/run_tests.py)")
    table = sk.builds()
    compared = 0
    for release, skeleton, entry in cuda:
        recorded = entry["sha256"]
        assert recorded, release
        for name, want in recorded.items():
            assert digest(skeleton / name) == want
        # Files of the patches both builds run (a CPU-only patch's target may differ).
        shared = {name: recorded[name] for name in fingerprints_shared() if name in recorded}
        if sk.CPU in table[release]["builds"]:
            assert table[release]["targets_identical"] is True, release
            cpu_sha = table[release]["builds"][sk.CPU]["sha256"]
            assert {n: cpu_sha.get(n) for n in shared} == shared, release
        if release in cpu:
            for name, want in shared.items():
                assert digest(cpu[release] / name) == want, (release, name)
            compared += 1
    assert compared >= 1 or not cpu, "no release with both an overlay and a skeleton"
