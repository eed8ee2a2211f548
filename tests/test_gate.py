"""Release gate on real and synthetic version strings, and the decision table."""

from __future__ import annotations

import pytest
from packaging.version import Version

from vllm_hsfix import gate
from vllm_hsfix.patches import FIXED_FROM, PATCHES, by_id


@pytest.mark.parametrize(
    ("version", "scatter", "connector"),
    [
        ("0.16.9", "not-needed", "not-needed"),
        ("0.17.0", "apply", "not-needed"),
        ("0.17.0+cpu", "apply", "not-needed"),
        ("0.21.0", "apply", "not-needed"),
        ("0.23.0+cu128", "apply", "not-needed"),
        ("0.24.0", "apply", "apply"),
        ("0.24.0+cu128", "apply", "apply"),
        ("0.24.1.dev12+gabc", "apply", "apply"),
        ("0.24.0rc1", "apply", "apply"),
        ("0.25.0", "upstream-fix-present", "upstream-fix-present"),
        # A dev build of the fixed release is probed: its code decides (here: old shape).
        ("0.25.0.dev3", "apply", "apply"),
        ("0.28.0+cpu", "upstream-fix-present", "upstream-fix-present"),
        ("0.33.0", "upstream-fix-present", "upstream-fix-present"),
    ],
)
def test_release_gate(version: str, scatter: str, connector: str) -> None:
    shape = gate.Probe("known")

    def code(patch_id: str) -> str:
        return gate.decide(by_id(patch_id), version, None, False, lambda: shape, FIXED_FROM).code

    assert (code("scatter-clamp"), code("hidden-group-block-size")) == (scatter, connector)


def test_probe_decides_inside_the_range() -> None:
    patch = PATCHES[0]
    fixed = gate.decide(
        patch, "0.24.1.dev3", None, False, lambda: gate.Probe(None, fixed=True), FIXED_FROM
    )
    unknown = gate.decide(
        patch, "0.24.0", None, False, lambda: gate.Probe(None, detail="something else"), FIXED_FROM
    )
    assert fixed.code == "upstream-fix-present" and "upstream fix present" in fixed.reason
    assert unknown.code == "unknown-shape" and "something else" in unknown.reason


def test_probe_not_called_outside_the_range() -> None:
    def boom() -> gate.Probe:
        raise AssertionError("probed")

    assert gate.decide(PATCHES[0], "0.25.0", None, False, boom, FIXED_FROM).code == (
        "upstream-fix-present"
    )


def test_unknown_version_and_disabled() -> None:
    d = gate.decide(PATCHES[0], None, "weird build", False, lambda: gate.Probe("x"), FIXED_FROM)
    assert d.code == "unknown-version" and "weird build" in d.reason
    assert "VLLM_HSFIX_VLLM_VERSION" in d.reason
    off = gate.decide(PATCHES[0], "0.24.0", None, True, lambda: gate.Probe("x"), FIXED_FROM)
    assert off.code == "disabled"


def test_dev_and_local_builds_compare_by_release() -> None:
    assert gate.in_release_range(Version("0.24.1.dev12+gabc"), ">=0.17.0,<0.25.0")
    assert gate.in_release_range(Version("0.25.0rc1"), ">=0.17.0,<0.25.0")
    assert not gate.in_release_range(Version("0.25.0"), ">=0.17.0,<0.25.0")
    assert not gate.in_release_range(Version("0.16.2"), ">=0.17.0,<0.25.0")
    assert gate.in_release_range(Version("0.17.0+cpu"), ">=0.17.0,<0.25.0")
