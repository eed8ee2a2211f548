"""One activation, whatever fires, in fresh processes with the real vLLM."""

from __future__ import annotations

import pytest
from conftest import clean_env, declared_all, declared_code, last_json
from support.procs import child, child_json

from vllm_hsfix._version import __version__
from vllm_hsfix.patches import PATCHES

# The children assert 0.24.0's answers (every target wrapped once): the releases where
# hidden-group-block-size applies, not every release of the clamp.
pytestmark = [pytest.mark.needs_vllm, pytest.mark.applies("hidden-group-block-size")]


def strict_env(strict: bool) -> dict[str, str]:
    return clean_env(VLLM_HSFIX_STRICT="1" if strict else None)


# Each target wrapped exactly once by each of ours: register_kv_caches by the
# hidden-group-block-size patch and by the observer extra.
ONCE = {"basic_cache": 1, "__init__": 1, "register_kv_caches": 2, "_zero_block_ids": 1}


def test_status_after_import_shows_both_patches_applied_and_one_log_line() -> None:
    out = child("activation.py", "after_import")
    statuses, depths, sources = last_json(out.stdout)
    assert statuses == declared_all()
    assert depths == ONCE
    assert sources == ["import", "vllm-import"]
    lines = [ln for ln in out.stderr.splitlines() if f"vllm-hsfix {__version__} pid=" in ln]
    assert len(lines) == 1, out.stderr[-3000:]
    # Logged when vLLM is imported, decided from the files: patched on import.
    on_import = "scatter-clamp, hidden-group-block-size, aux-final-layer, cpu-zero-blocks"
    assert f"on import {on_import}" in lines[0]
    assert "role=main" in lines[0] and "vllm=0.24.0" in lines[0]


@pytest.mark.parametrize("order", ["targets-first", "package-first"])
def test_import_plugin_bootstrap_and_apply_patch_once(order: str) -> None:
    from vllm_hsfix.cli import BOOTSTRAP_DIR

    env = clean_env(PYTHONPATH=f"{BOOTSTRAP_DIR}:" + clean_env()["PYTHONPATH"])
    depths, sources, statuses = child_json("activation.py", "every_path", order, env=env)
    assert depths == ONCE
    assert sources[0] == "bootstrap"
    # `import vllm_hsfix` after the bootstrap finds the module already imported: no event.
    assert {"bootstrap", "plugin", "apply"} <= set(sources)
    assert statuses == declared_all()


def test_concurrent_activation_from_threads_patches_once() -> None:
    assert child_json("activation.py", "threads") == ONCE


def test_disable_switches() -> None:
    off = child_json("activation.py", "codes", env=clean_env(VLLM_HSFIX_DISABLE="1"))
    assert off == [
        dict.fromkeys(ONCE, 0),
        {
            p.id: ("disabled" if code == "would-apply" else code)
            for p, code in ((p, declared_code(p)) for p in PATCHES)
        },
    ]
    env = clean_env(VLLM_HSFIX_DISABLED_PATCHES="scatter-clamp")
    one = child_json("activation.py", "codes", env=env)
    assert one == [
        {**ONCE, "basic_cache": 0},
        {
            **{
                p.id: ("applied" if code == "would-apply" else code)
                for p, code in ((p, declared_code(p)) for p in PATCHES)
            },
            "scatter-clamp": "disabled",
        },
    ]


@pytest.mark.parametrize("strict", [False, True])
def test_a_failure_inside_activation_escapes_only_in_strict_mode(strict: bool) -> None:
    out = child("activation.py", "failing_detect", env=strict_env(strict))
    if strict:
        # the status() call itself would re-raise, so only the import result is checked
        raised = last_json(out.stdout)[0]
        assert raised is not None and raised.startswith("HsfixError")
        assert "forced failure inside activation" in raised
    else:
        raised, codes = last_json(out.stdout)
        assert raised is None, raised
        assert codes == dict.fromkeys(declared_all(), "error")
        assert "forced failure inside activation" in out.stderr


@pytest.mark.parametrize("strict", [False, True])
def test_plugin_never_raises_into_vllm_unless_strict(strict: bool) -> None:
    out = child("activation.py", "failing_plugin", env=strict_env(strict))
    assert last_json(out.stdout) == ("HsfixError" if strict else None)
    assert "forced failure in the plugin" in out.stderr
