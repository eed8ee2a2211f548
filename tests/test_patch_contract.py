"""Every row's implementation module keeps the patch contract (``patches.PatchModule``),
checked when it is loaded; one that does not is refused with what it lacks. Static: the
implementation modules import no vLLM and no torch at module level."""

from __future__ import annotations

import pytest

from vllm_hsfix.patches import PATCHES, PatchModule, by_id


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.id)
def test_every_row_keeps_the_contract(patch) -> None:  # type: ignore[no-untyped-def]
    """The row's module (``patches/<id>.py``) implements the contract for its id, and
    the row lists at least one name it wraps, each once (tests/test_patch_wraps.py
    checks them against what apply() replaces on the live release)."""
    assert patch.impl == "vllm_hsfix.patches." + patch.id.replace("-", "_")
    mod = patch.implementation()
    assert isinstance(mod, PatchModule)
    assert patch.id == mod.PATCH_ID
    assert patch.wraps and len(set(patch.wraps)) == len(patch.wraps)


def test_a_module_without_the_contract_is_refused() -> None:
    row = by_id("atomic-writes")._replace(impl="vllm_hsfix.patches.hooks")
    with pytest.raises(TypeError, match="does not implement the patch contract"):
        row.implementation()


def test_a_module_of_another_row_is_refused() -> None:
    row = by_id("atomic-writes")._replace(impl="vllm_hsfix.patches.scatter_clamp")
    with pytest.raises(TypeError, match="the row is 'atomic-writes'"):
        row.implementation()
