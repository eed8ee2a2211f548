"""``plan.decide``, the one decision function: release gate on real and synthetic
version strings, switches, and the order of the questions. Static: no torch, no vLLM
import (runs on Python 3.10-3.13)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from packaging.version import Version

from vllm_hsfix import plan
from vllm_hsfix.config import Config
from vllm_hsfix.detect import VllmInstall, from_version
from vllm_hsfix.patches import PATCHES, PatchSpec, by_id
from vllm_hsfix.shapes import Probe

ON = Config()
OFF = Config(disabled=True)


def decide(
    patch: PatchSpec,
    version: str | None,
    probe: Callable[[], Probe],
    cfg: Config = ON,
    problem: str | None = None,
) -> plan.Decision:
    inst = (
        from_version("vllm", version, "/x/vllm/__init__.py", "metadata")
        if version
        else VllmInstall(present=True, problem=problem)
    )
    return plan.decide(patch, inst, cfg, probe)


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
    shape = Probe("known")

    def code(patch_id: str) -> str:
        return decide(by_id(patch_id), version, lambda: shape).code

    assert (code("scatter-clamp"), code("hidden-group-block-size")) == (scatter, connector)


def test_probe_decides_inside_the_range() -> None:
    patch = PATCHES[0]
    fixed = decide(patch, "0.24.1.dev3", lambda: Probe(None, fixed=True))
    unknown = decide(patch, "0.24.0", lambda: Probe(None, detail="something else"))
    assert fixed.code == "upstream-fix-present" and "upstream fix present" in fixed.reason
    assert unknown.code == "unknown-shape" and "something else" in unknown.reason


def test_probe_not_called_outside_the_range() -> None:
    def boom() -> Probe:
        raise AssertionError("probed")

    assert decide(PATCHES[0], "0.25.0", boom).code == "upstream-fix-present"
    assert decide(PATCHES[0], "0.24.0", boom, OFF).code == "disabled"


def test_unknown_version_and_disabled() -> None:
    d = decide(PATCHES[0], None, lambda: Probe("x"), problem="weird build")
    assert d.code == "unknown-version" and "weird build" in d.reason
    assert "VLLM_HSFIX_VLLM_VERSION" in d.reason
    off = decide(PATCHES[0], "0.24.0", lambda: Probe("x"), OFF)
    assert off.code == "disabled" and "VLLM_HSFIX_DISABLE=1" in off.reason
    one = decide(
        PATCHES[0],
        "0.24.0",
        lambda: Probe("x"),
        Config(disabled_patches=frozenset({"scatter-clamp"})),
    )
    assert one.code == "disabled" and "VLLM_HSFIX_DISABLED_PATCHES" in one.reason
    assert decide(PATCHES[0], None, lambda: Probe("x"), OFF, problem="weird").code == "disabled"


@pytest.mark.parametrize("version", ["0.25.0", "0.32.0+cpu"])
def test_disabling_a_fixed_release_changes_nothing(version: str) -> None:
    # Issue 11.11: on a fixed vLLM there is nothing to turn off, so the answer (and
    # `vllm-hsfix status`'s exit code) does not depend on the switch.
    for patch in PATCHES:
        assert decide(patch, version, lambda: Probe("x"), OFF).code == "upstream-fix-present"


def test_no_vllm() -> None:
    d = plan.decide(PATCHES[0], VllmInstall(present=False), ON, lambda: Probe("x"))
    assert d.code == "no-vllm"


def test_dev_and_local_builds_compare_by_release() -> None:
    assert plan.in_release_range(Version("0.24.1.dev12+gabc"), ">=0.17.0,<0.25.0")
    assert plan.in_release_range(Version("0.25.0rc1"), ">=0.17.0,<0.25.0")
    assert not plan.in_release_range(Version("0.25.0"), ">=0.17.0,<0.25.0")
    assert not plan.in_release_range(Version("0.16.2"), ">=0.17.0,<0.25.0")
    assert plan.in_release_range(Version("0.17.0+cpu"), ">=0.17.0,<0.25.0")
