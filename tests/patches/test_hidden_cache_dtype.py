"""``hidden-cache-dtype`` on the release's own code (issue 57): with an fp8 KV cache the
drafter model and its hidden-states layer build, as the drafter loader builds them
(``initialize_model`` on the engine's config); without the row, AssertionError."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from conftest import CACHE
from support import spec_decode

from vllm_hsfix.patches import by_id

pytestmark = [pytest.mark.needs_vllm, pytest.mark.applies("hidden-cache-dtype")]
ROW = by_id("hidden-cache-dtype")


@pytest.fixture(scope="module")
def dense() -> Any:
    from hsfix_demo import tiny_model

    return tiny_model.build(CACHE / "models" / "dense", "dense")


def fp8_engine(path: Any) -> Any:
    """An engine config with an fp8 KV cache, as a CUDA platform leaves it. vLLM's CPU
    platform takes fp8 only without chunked prefill and prefix caching, then falls back
    to "auto" (no fp8 cache kernels): the cache dtype is put back as CUDA keeps it."""
    config = spec_decode.engine_config(
        path, cache_dtype="fp8", enable_chunked_prefill=False, enable_prefix_caching=False
    )
    config.cache_config.cache_dtype = "fp8"
    return config


def drafter(config: Any) -> Any:
    """The drafter model as ``ExtractHiddenStatesProposer.load_model`` gets it: the
    loader's ``initialize_model`` on the draft model config, under the engine's config."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    draft = config.speculative_config.draft_model_config
    with set_current_vllm_config(config):
        return initialize_model(vllm_config=config, model_config=draft)


def layer(config: Any, module: Any) -> Any:
    """The release's cache-only layer, built directly with the engine's cache config."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config):
        return module.CacheOnlyAttentionLayer(
            num_heads=2, head_size=256, cache_config=config.cache_config, prefix="hs.0"
        )


def test_unpatched_release_cannot_load_the_drafter_under_fp8(dense: Any) -> None:
    """Failing first: the release's code as it ships."""
    import vllm_hsfix

    vllm_hsfix.unapply()
    module = importlib.import_module(ROW.module)
    assert getattr(module.CacheOnlyAttentionLayer.__init__, "hsfix_patch", None) is None
    config = fp8_engine(dense)
    with pytest.raises(AssertionError, match="quantized kv cache"):
        drafter(config)
    with pytest.raises(AssertionError, match="quantized kv cache"):
        layer(config, module)


def test_patched_release_builds_the_layer_under_fp8(patched: Any, dense: Any) -> None:
    """The row as the runtime applies it (fails with VLLM_HSFIX_DISABLED_PATCHES=
    hidden-cache-dtype): the hidden states keep the model's dtype, the engine's
    attention cache stays fp8."""
    import torch

    module = importlib.import_module(ROW.module)
    assert patched.status()["patches"][ROW.id]["status"] == "applied"
    config = fp8_engine(dense)
    model = drafter(config)
    assert type(model).__name__ == "ExtractHiddenStatesModel"
    for built in (*model.cache_only_layers.values(), layer(config, module)):
        assert built.kv_cache_torch_dtype == torch.bfloat16
        assert built.impl.kv_cache_dtype == "auto"
        assert built.get_kv_cache_spec(config).dtype == torch.bfloat16
    assert config.cache_config.cache_dtype == "fp8"


def test_patched_release_leaves_an_unquantized_cache_as_it_is(patched: Any, dense: Any) -> None:
    import torch

    config = spec_decode.engine_config(dense, cache_dtype="bfloat16")
    (built,) = drafter(config).cache_only_layers.values()
    assert (built.impl.kv_cache_dtype, built.kv_cache_torch_dtype) == ("bfloat16", torch.bfloat16)
