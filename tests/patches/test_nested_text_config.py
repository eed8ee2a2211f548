"""``nested-text-config`` on the release's own code (issue 57): its ``SpeculativeConfig``
for ``extract_hidden_states`` builds for a real nested-config verifier, a tiny Qwen3-VL
checkpoint made with transformers' classes; without the row it raises ValueError."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
from conftest import CACHE
from support import spec_decode

from vllm_hsfix.patches import by_id

pytestmark = [pytest.mark.needs_vllm, pytest.mark.applies("nested-text-config")]
ROW = by_id("nested-text-config")


@pytest.fixture(scope="module")
def verifier() -> Any:
    """The release's ``ModelConfig`` of a tiny Qwen3-VL (text_config: qwen3_vl_text)."""
    path = spec_decode.qwen3_vl_checkpoint(CACHE / "models" / "qwen3-vl-tiny")
    config = spec_decode.model_config(path)
    assert config.hf_text_config.model_type == "qwen3_vl_text"
    return config


def test_unpatched_release_rejects_the_verifier(verifier: Any) -> None:
    """Failing first: the release's code as it ships."""
    import vllm_hsfix

    vllm_hsfix.unapply()
    module = importlib.import_module(ROW.module)
    assert getattr(module.ExtractHiddenStatesConfig.__init__, "hsfix_patch", None) is None
    with pytest.raises(ValueError, match="num_attention_heads"):
        spec_decode.speculative_config(verifier)


def test_patched_release_builds_the_drafter_config(patched: Any, verifier: Any) -> None:
    """The row as the runtime applies it (fails with
    VLLM_HSFIX_DISABLED_PATCHES=nested-text-config)."""
    importlib.import_module(ROW.module)
    assert patched.status()["patches"][ROW.id]["status"] == "applied"
    draft = spec_decode.speculative_config(verifier).draft_model_config
    text = draft.hf_text_config
    assert type(text) is type(verifier.hf_text_config)
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (2, 1, 128)
    assert draft.architectures == ["ExtractHiddenStatesModel"]
    assert draft.hf_config.eagle_aux_hidden_state_layer_ids == spec_decode.AUX_LAYERS


def test_the_checkpoint_is_shaped_like_the_released_model(tmp_path: Path) -> None:
    """What makes the verifier a nested one: a composite config whose text config is its
    own object (the case the release flattens)."""
    from transformers import AutoConfig

    path = spec_decode.qwen3_vl_checkpoint(CACHE / "models" / "qwen3-vl-tiny")
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.model_type == "qwen3_vl" and cfg.get_text_config() is not cfg
    assert cfg.get_text_config().head_dim == 128
