"""``cpu-sampler-fp64-flag`` on the real installed vLLM: the release's CPU stand-in for
the recovered-token sampler refuses the keyword its 0.23+ caller passes."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from vllm_hsfix.patches.cpu_sampler_fp64_flag import fix as sampler

pytestmark = pytest.mark.needs_vllm
SAMPLER_MODULE = "vllm.utils.cpu_triton_utils"
needs_sampler = pytest.mark.applies(sampler.PATCH_ID)


def _sampler_module() -> Any:
    return importlib.import_module(SAMPLER_MODULE)


@needs_sampler
def test_the_release_sampler_rejects_the_keyword_its_caller_passes() -> None:
    """Failing first: the release's stand-in, called as the 0.23+ sampler calls it."""
    import vllm_hsfix

    vllm_hsfix.unapply()
    with pytest.raises(TypeError, match="USE_FP64_GUMBEL"):
        sampler.check_recovered_tokens(_sampler_module())


@needs_sampler
def test_the_patched_sampler_recovers_the_right_tokens(patched: Any) -> None:
    """... and hands every other kernel out unchanged."""
    module = _sampler_module()
    assert patched.status()["patches"][sampler.PATCH_ID]["status"] == "applied"
    assert sampler.check_recovered_tokens(module) == []
    assert module.expand_kernel[(1,)] is module.expand_kernel.func
    kernel = module.sample_recovered_tokens_kernel
    assert kernel[(1,)] is not kernel.func
