"""The shape gate on the installed release's live targets: the file's answer, and a refusal
of an altered or foreign target."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest
from conftest import MODEL_MODULE, clean_env, last_json
from support.procs import child, child_json

from vllm_hsfix import shapes
from vllm_hsfix.patches.scatter_clamp import fix as scatter

pytestmark = pytest.mark.needs_vllm


def test_static_probe_of_the_file_matches_the_live_probe() -> None:
    module = importlib.import_module(MODEL_MODULE)
    live = scatter.probe(module)
    static = shapes.probe_file(module.__file__, scatter.probe_tree)
    assert (static.shape, static.fixed, static.fingerprints) == (
        live.shape,
        live.fixed,
        live.fingerprints,
    )


@pytest.mark.applies("scatter-clamp")
def test_an_altered_target_is_refused_end_to_end(tmp_path: Path) -> None:
    """A vendor build whose basic_cache changed: refused, warned, left alone; strict: fails."""
    src = Path(importlib.util.find_spec(MODEL_MODULE).origin).read_text()  # type: ignore[union-attr]
    old = "slot_mapping % block_size" if "slot_mapping % block_size" in src else "[slot_mapping]"
    new = (
        "slot_mapping.remainder(block_size)" if old.startswith("slot") else "[slot_mapping.long()]"
    )
    path = tmp_path / "ehs.py"
    path.write_text(src.replace(old, new, 1))
    out = child("lookups.py", "altered_target", path)
    status, reason, untouched = last_json(out.stdout)
    assert status == "refused" and untouched
    assert "does not look like any known shape" in reason and "none of the known stores" in reason
    assert "scatter-clamp refused" in out.stderr  # the warning a user sees
    # Strict mode: the same refusal stops the process at activation.
    strict = child_json("lookups.py", "altered_target", path, env=clean_env(VLLM_HSFIX_STRICT="1"))
    want = "HsfixError: strict mode: the fix cannot apply: scatter-clamp: unknown-shape: "
    assert strict.startswith(want), strict  # as status names it (views.not_in_place)


@pytest.mark.applies("scatter-clamp")
def test_a_target_replaced_by_someone_else_is_refused() -> None:
    module = importlib.import_module(MODEL_MODULE)
    original = module.basic_cache

    def other_hotfix(to_cache, kv_cache, slot_mapping):  # type: ignore[no-untyped-def]
        return original(to_cache, kv_cache, slot_mapping)

    module.basic_cache = other_hotfix
    try:
        probe = scatter.probe(module)
    finally:
        module.basic_cache = original
    assert probe.shape is None and not probe.fixed and "was replaced by" in probe.detail
