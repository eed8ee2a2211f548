"""CI's releases cover the patch table: for every row, CI runs at least one release the
row applies on, and for a row upstream fixed, one release that carries the fix. A row
whose range no CI release reaches fails here, naming the row (add a release to
``scripts/run_tests.py``'s ``FULL`` or ``SUBSET``). Static: no vLLM needed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import run_tests  # noqa: E402

from vllm_hsfix.patches import PATCHES  # noqa: E402


def _key(release: str) -> tuple[int, ...]:
    # Written here, not taken from vllm_hsfix.releases: the expectation is independent.
    return tuple(int(p) for p in release.split(".")[:3])


CI_RELEASES = run_tests.FULL + run_tests.SUBSET


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.id)
def test_ci_runs_a_release_in_every_rows_range(patch) -> None:  # type: ignore[no-untyped-def]
    inside = [r for r in CI_RELEASES if _key(patch.first) <= _key(r) < _key(patch.fixed_in)]
    assert inside, f"{patch.id}: no CI release in {patch.first} - {patch.fixed_in}"


@pytest.mark.parametrize("patch", [p for p in PATCHES if p.upstream_fixed], ids=lambda p: p.id)
def test_ci_runs_a_release_with_every_upstream_fix(patch) -> None:  # type: ignore[no-untyped-def]
    fixed = [r for r in CI_RELEASES if _key(r) >= _key(patch.fixed_in)]
    assert fixed, f"{patch.id}: no CI release at or past its fix ({patch.fixed_in})"


def test_is_fixed_follows_the_46301_rows() -> None:
    """``run_tests.is_fixed`` (which release's image tests are optional) reads the table:
    0.24.0 is before PR 46301's release, 0.25.0 and later carry it."""
    assert not run_tests.is_fixed("0.24.0")
    assert run_tests.is_fixed("0.25.0") and run_tests.is_fixed("0.32.0")
