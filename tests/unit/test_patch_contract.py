"""Every row's module keeps the patch contract (``patches.PatchModule``) or is refused
with what it lacks, and every row's tests are found by its id; static."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_hsfix.patches import PATCHES, PatchModule, by_id


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.id)
def test_every_row_keeps_the_contract(patch) -> None:  # type: ignore[no-untyped-def]
    """The row's module implements the contract for its id and lists each wrapped name once."""
    assert patch.impl == "vllm_hsfix.patches." + patch.id.replace("-", "_") + ".fix"
    mod = patch.implementation()
    assert isinstance(mod, PatchModule)
    assert patch.id == mod.PATCH_ID
    assert patch.wraps and len(set(patch.wraps)) == len(patch.wraps)


def test_a_module_without_the_contract_is_refused() -> None:
    row = by_id("atomic-writes")._replace(impl="vllm_hsfix.patches.hooks")
    with pytest.raises(TypeError, match="does not implement the patch contract"):
        row.implementation()


def test_a_module_of_another_row_is_refused() -> None:
    row = by_id("atomic-writes")._replace(impl="vllm_hsfix.patches.scatter_clamp.fix")
    with pytest.raises(TypeError, match="the row is 'atomic-writes'"):
        row.implementation()


def test_every_row_has_its_own_test_file() -> None:
    """``tests/patches/test_<unit>.py`` for each row, and no file there without a row:
    ``pytest --patch ID`` (tests/conftest.py) finds a row's tests by its id."""
    files = Path(__file__).resolve().parents[1] / "patches"
    found = {f.stem.removeprefix("test_") for f in files.glob("test_*.py")}
    assert found == {p.id.replace("-", "_") for p in PATCHES}
