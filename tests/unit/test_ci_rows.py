"""CI's rows agree with the patch table (static): every row has a CI release it applies on
(and a fixed one where upstream fixed it), and the ``upstream`` row's suites name real
patches and run only where those patches or upstream's fix apply."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import run_tests  # noqa: E402

from vllm_hsfix.patches import PATCH_IDS, PATCHES, by_id  # noqa: E402
from vllm_hsfix.releases import key as release_key  # noqa: E402


def _key(release: str) -> tuple[int, ...]:
    # Written here, not taken from vllm_hsfix.releases: the expectation is independent.
    return tuple(int(p) for p in release.split(".")[:3])


CI_RELEASES = run_tests.FULL + run_tests.SUBSET


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.id)
def test_ci_runs_a_release_in_every_rows_range(patch) -> None:  # type: ignore[no-untyped-def]
    end = _key(patch.fixed_in) if patch.fixed_in else (99, 0, 0)
    inside = [r for r in CI_RELEASES if _key(patch.first) <= _key(r) < end]
    assert inside, f"{patch.id}: no CI release in {patch.first} - {patch.fixed_in}"


@pytest.mark.parametrize("patch", [p for p in PATCHES if p.fixed_in], ids=lambda p: p.id)
def test_ci_runs_a_release_with_every_upstream_fix(patch) -> None:  # type: ignore[no-untyped-def]
    fixed = [r for r in CI_RELEASES if _key(r) >= _key(patch.fixed_in)]
    assert fixed, f"{patch.id}: no CI release at or past its fix ({patch.fixed_in})"


def test_is_fixed_follows_the_46301_rows() -> None:
    """``run_tests.is_fixed`` (which release's image tests are optional) reads the table:
    0.24.0 is before PR 46301's release, 0.25.0 and later carry it."""
    assert not run_tests.is_fixed("0.24.0")
    assert run_tests.is_fixed("0.25.0") and run_tests.is_fixed("0.32.0")


UPSTREAM = ROOT / "tests" / "upstream"
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10; the driver's Python is 3.11+
    tomllib = None  # type: ignore[assignment]
SUITES = tomllib.loads((UPSTREAM / "upstream_tests.toml").read_text())["suite"] if tomllib else []


def test_the_driver_and_its_plugin_are_there() -> None:
    assert (ROOT / "scripts" / "upstream_tests.py").is_file()
    assert (UPSTREAM / "hsfix_upstream_plugin.py").is_file()


@pytest.mark.parametrize("suite", SUITES, ids=[s["id"] for s in SUITES])
def test_suite_agrees_with_the_patch_table(suite: dict[str, Any]) -> None:
    assert suite["patches"] and set(suite["patches"]) <= set(PATCH_IDS)
    assert suite["tests"] and len(set(suite["tests"])) == len(suite["tests"])
    assert suite["patched"], "a suite runs on at least one release the patch covers"
    for pid in suite["patches"]:
        row = by_id(pid)
        for release in suite["patched"]:
            assert release_key(row.first) <= release_key(release)
            assert row.fixed_in is None or release_key(release) < release_key(row.fixed_in)
        for release in suite["fixed"]:
            assert release_key(release) >= release_key(row.fixed_in)
    kind, _, spec = suite["source"].partition(":")
    assert kind in ("sdist", "github")
    if kind == "sdist":  # the release that carries the fix (and its tests)
        assert all(release_key(spec) >= release_key(by_id(p).fixed_in) for p in suite["patches"])
    else:
        assert "@" in spec and len(spec.split("@", 1)[1]) == 40, "a full commit: immutable"
    for test, why in suite.get("unpatched_passes", {}).items():
        assert test in suite["tests"] and why.strip()
    for key, why in suite.get("not_runnable", {}).items():
        test, release = key.split(" @ ")
        assert test in suite["tests"] and why.strip()
        assert release in suite["patched"] + suite["fixed"]
    for module, names in suite.get("shims", {}).items():
        assert module.startswith("vllm.") and names
