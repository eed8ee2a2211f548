"""Environment switches: every bad value is reported, never raised."""

from __future__ import annotations

from vllm_hsfix import config
from vllm_hsfix.patches import PATCH_IDS


def test_defaults_patch_everything() -> None:
    cfg = config.load({})
    assert (cfg.disabled, cfg.strict, cfg.verify, cfg.disabled_patches) == (
        False,
        False,
        True,
        frozenset(),
    )
    assert cfg.warnings == ()


def test_switches_are_read() -> None:
    cfg = config.load(
        {
            "VLLM_HSFIX_STRICT": "yes",
            "VLLM_HSFIX_DISABLED_PATCHES": " scatter-clamp , ",
            "VLLM_HSFIX_VERIFY": "0",
            "VLLM_HSFIX_VLLM_VERSION": "0.24.0",
        },
        known_patches=PATCH_IDS,
    )
    assert cfg.strict and not cfg.verify
    assert cfg.disabled_patches == {"scatter-clamp"}
    assert cfg.vllm_version_override == "0.24.0"
    assert cfg.warnings == ()


def test_bad_boolean_warns_and_keeps_default() -> None:
    cfg = config.load({"VLLM_HSFIX_STRICT": "maybe"})
    assert cfg.strict is False
    assert any("VLLM_HSFIX_STRICT='maybe'" in w for w in cfg.warnings)


def test_unknown_patch_id_is_named() -> None:
    cfg = config.load({"VLLM_HSFIX_DISABLED_PATCHES": "scatter-clmap"}, known_patches=PATCH_IDS)
    assert any("scatter-clmap" in w and "scatter-clamp" in w for w in cfg.warnings)


def test_disable_and_strict_conflict_is_reported_and_disable_wins() -> None:
    cfg = config.load({"VLLM_HSFIX_DISABLE": "1", "VLLM_HSFIX_STRICT": "1"})
    assert cfg.disabled and not cfg.strict
    assert any("conflict" in w for w in cfg.warnings)


def test_bad_log_level_falls_back() -> None:
    cfg = config.load({"VLLM_HSFIX_LOG_LEVEL": "chatty"})
    assert cfg.log_level == "INFO" and cfg.warnings
