"""Every row's implementation module keeps the patch contract (``patches.PatchModule``),
checked when it is loaded; one that does not is refused with what it lacks. Static: the
implementation modules import no vLLM and no torch at module level."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import INSTALL, clean_env, declared, last_json, run_py

from vllm_hsfix.patches import PATCHES, PatchModule, by_id


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.id)
def test_every_row_keeps_the_contract(patch) -> None:  # type: ignore[no-untyped-def]
    mod = patch.implementation()
    assert isinstance(mod, PatchModule)
    assert patch.id == mod.PATCH_ID


def test_a_module_without_the_contract_is_refused() -> None:
    row = dataclasses.replace(by_id("atomic-writes"), impl="vllm_hsfix.patches.hooks")
    with pytest.raises(TypeError, match="does not implement the patch contract"):
        row.implementation()


def test_a_module_of_another_row_is_refused() -> None:
    row = dataclasses.replace(by_id("atomic-writes"), impl="vllm_hsfix.patches.scatter_clamp")
    with pytest.raises(TypeError, match="the row is 'atomic-writes'"):
        row.implementation()


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.id)
def test_a_patch_is_found_by_its_id(patch) -> None:  # type: ignore[no-untyped-def]
    """``patches/<id>.py``: the module of a row is named by its patch id."""
    assert patch.impl == "vllm_hsfix.patches." + patch.id.replace("-", "_")


APPLY_EACH_ROW = """
import importlib, json
from vllm_hsfix.patches import PATCHES
from vllm_hsfix.patches._wrap import ABSENT
from vllm_hsfix.patches.hooks import Hooks
hooks = Hooks(on_failure=lambda *a: None, after_register=lambda c: None)
out = {}
for row in {ids}:
    row = [p for p in PATCHES if p.id == row][0]
    module = importlib.import_module(row.module)
    impl = row.implementation()
    reps = impl.apply(module, impl.probe(module).shape, hooks)
    out[row.id] = sorted(
        (r.name if isinstance(r.owner, type(module)) else f"{r.owner.__name__}.{r.name}")
        + (" (added)" if r.original is ABSENT else "")
        for r in reps
    )
    for r in reversed(reps):
        r.restore()
print(json.dumps(out))
"""


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.id)
def test_every_row_names_what_it_wraps(patch) -> None:  # type: ignore[no-untyped-def]
    """A row lists at least one name, each once, each in its module."""
    assert patch.wraps and len(set(patch.wraps)) == len(patch.wraps)


@pytest.mark.needs_vllm
def test_a_row_wraps_exactly_the_names_it_lists() -> None:
    """Each row that applies on the installed release, applied by itself to the real
    module (vllm-hsfix otherwise off): the names it replaces or adds are the row's
    ``wraps``, no more, no fewer."""
    rows = [p for p in PATCHES if declared(p) == "applied"]
    if not rows:
        pytest.skip(f"no row applies on vLLM {INSTALL.release}")
    proc = run_py(
        APPLY_EACH_ROW.replace("{ids}", repr([p.id for p in rows])),
        env=clean_env(VLLM_HSFIX_DISABLE="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = last_json(proc.stdout)
    assert got == {p.id: sorted(p.wraps) for p in rows}
