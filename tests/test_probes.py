"""The shape gate on the real targets of the installed release, and on altered copies."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest
from conftest import CONNECTOR_MODULE, FIXED, MODEL_MODULE, RELEASE, last_json, run_py
from packaging.version import Version

from vllm_hsfix import shapes
from vllm_hsfix.patches import hidden_group_block_size as connector
from vllm_hsfix.patches import scatter_clamp as scatter

pytestmark = pytest.mark.needs_vllm


def expected_scatter_shape() -> str:
    v = Version(RELEASE or "0")
    if FIXED:
        return "fixed"
    return "2d-index" if v >= Version("0.22.0") else "flat-view"


def test_scatter_probe_recognises_the_real_target() -> None:
    module = importlib.import_module(MODEL_MODULE)
    probe = scatter.probe(module)
    got = "fixed" if probe.fixed else probe.shape
    assert got == expected_scatter_shape(), probe.detail
    assert len(probe.fingerprints["basic_cache"]) == 16


def test_connector_probe_on_the_real_target() -> None:
    module = importlib.import_module(CONNECTOR_MODULE)
    probe = connector.probe(module)
    if FIXED:
        assert probe.fixed and probe.shape is None
    elif Version(RELEASE or "0") >= Version("0.24.0"):
        assert probe.shape == "0.24-worker-rebuild", probe.detail
    else:
        # 0.17-0.23 are never probed for this patch (release gate), and do not match.
        assert not probe.known


def test_static_probe_of_the_file_matches_the_live_probe() -> None:
    module = importlib.import_module(MODEL_MODULE)
    live = scatter.probe(module)
    static = shapes.probe_file(module.__file__, scatter.probe_tree)
    assert (static.shape, static.fixed, static.fingerprints) == (
        live.shape,
        live.fixed,
        live.fingerprints,
    )


def _altered_copy(tmp_path: Path, module_name: str, old: str, new: str) -> object:
    src = Path(importlib.import_module(module_name).__file__).read_text()
    assert old in src, f"the line to alter is not in {module_name} of {RELEASE}"
    path = tmp_path / "altered.py"
    path.write_text(src.replace(old, new, 1))
    spec = importlib.util.spec_from_file_location(f"altered_{tmp_path.name}", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.applies("scatter-clamp")
def test_one_line_changed_in_basic_cache_is_refused(tmp_path: Path) -> None:
    if Version(RELEASE or "0") >= Version("0.22.0"):
        old, new = "block_size = kv_cache.shape[1]", "block_size = kv_cache.size(1)"
    else:
        old, new = (
            "token_kv_cache[slot_mapping] = to_cache",
            "token_kv_cache.index_copy_(0, slot_mapping, to_cache)",
        )
    probe = scatter.probe(_altered_copy(tmp_path, MODEL_MODULE, old, new))
    assert not probe.known
    assert "none of the known stores" in probe.detail


@pytest.mark.applies("scatter-clamp")
def test_one_line_changed_in_the_connector_is_refused(tmp_path: Path) -> None:
    if Version(RELEASE or "0") < Version("0.24.0"):
        pytest.skip("the connector patch is only probed on 0.24")
    old = "self._block_size = vllm_config.cache_config.block_size"
    probe = connector.probe(_altered_copy(tmp_path, CONNECTOR_MODULE, old, "self._block_size = 16"))
    assert not probe.known
    assert "__init__ sets self._block_size from vllm_config.cache_config.block_size" in probe.detail


@pytest.mark.applies("scatter-clamp")
def test_an_altered_target_is_refused_end_to_end(tmp_path: Path) -> None:
    """A vendor build whose basic_cache changed: refused, warned, left untouched."""
    src = Path(importlib.util.find_spec(MODEL_MODULE).origin).read_text()  # type: ignore[union-attr]
    old = "slot_mapping % block_size" if "slot_mapping % block_size" in src else "[slot_mapping]"
    new = (
        "slot_mapping.remainder(block_size)" if old.startswith("slot") else "[slot_mapping.long()]"
    )
    path = tmp_path / "ehs.py"
    path.write_text(src.replace(old, new, 1))
    out = run_py(
        f"""
        import importlib.util, json, sys
        spec = importlib.util.spec_from_file_location({MODEL_MODULE!r}, {str(path)!r})
        mod = importlib.util.module_from_spec(spec)
        sys.modules[{MODEL_MODULE!r}] = mod
        spec.loader.exec_module(mod)
        original = mod.basic_cache
        import vllm_hsfix
        st = vllm_hsfix.status()["patches"]["scatter-clamp"]
        print(json.dumps([st["status"], st["reason"], mod.basic_cache is original]))
        """
    )
    status, reason, untouched = last_json(out.stdout)
    assert status == "refused" and untouched
    assert "does not look like any known shape" in reason and "none of the known stores" in reason
    assert "scatter-clamp refused" in out.stderr  # the warning a user sees


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
    assert not probe.known and "was replaced by" in probe.detail


def test_probes_do_not_need_vllm_imported() -> None:
    # The static path used by `vllm-hsfix status`: parse the files, import nothing.
    out = run_py(
        """
        import importlib.util, json, sys, os
        from vllm_hsfix import detect, shapes
        from vllm_hsfix.patches import scatter_clamp as scatter
        root = os.path.dirname(detect.detect().location)
        p = shapes.probe_file(os.path.join(root, "model_executor/models/extract_hidden_states.py"),
                            scatter.probe_tree)
        print(json.dumps([p.shape, p.fixed, "vllm" in sys.modules, "torch" in sys.modules]))
        """
    )
    shape, fixed, vllm_loaded, torch_loaded = last_json(out.stdout)
    assert ("fixed" if fixed else shape) == expected_scatter_shape()
    assert not vllm_loaded and not torch_loaded
