"""``next-token-last-valid`` on the release's own proposer (vLLM issue 56417, PR 56442):
``prepare_next_token_ids_padded`` with the tensors the GPU runner passes after a step
that verified a draft: [B, 2] sampled tokens, -1 where the draft was rejected, and a
discarded request (a partial prefill). Expected by hand, EAGLE's rule: the last valid
token of each row and the number of valid ones; a discarded request takes its backup
token (the last token the request holds) and counts none."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import CACHE
from support import spec_decode

from vllm_hsfix.patches import by_id

pytestmark = [pytest.mark.needs_vllm, pytest.mark.applies("next-token-last-valid")]
ROW = by_id("next-token-last-valid")
# Three requests verifying one draft token each: A's draft accepted (the model repeated
# 18), B's rejected, C discarded. Each holds a 5-token prompt and one output token.
SAMPLED = [[15, 18], [21, -1], [31, 32]]
DISCARD = [False, False, True]
WANT = ([18, 21, 26], [2, 1, 0])  # C's backup: its last token, 26
FIRST_COLUMN = ([15, 21, 26], [1, 1, 1])  # what reading column 0 alone gives


@pytest.fixture(scope="module")
def drafter() -> Any:
    from hsfix_demo import tiny_model

    return spec_decode.bare_proposer(tiny_model.build(CACHE / "models" / "dense", "dense"))


def release_method(drafter: Any) -> Any:
    """The release's own method, whatever wraps it (vLLM's plugin loading applied
    vllm-hsfix when the engine config was built)."""
    from vllm_hsfix.patches._wrap import original_of

    raw = type(drafter).__dict__["prepare_next_token_ids_padded"]
    return original_of(raw).__get__(drafter)  # type: ignore[attr-defined]


def prepare(drafter: Any, method: Any = None) -> tuple[list[int], list[int]]:
    """The method (the live one unless given) as ``GPUModelRunner`` calls it, on the
    runner state it reads: the real ``CachedRequestState`` of each request, the four
    fields of the input batch it reads."""
    import numpy as np
    import torch
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    ids = ["A", "B", "C"]
    requests = {
        r: CachedRequestState(req_id=r, prompt_token_ids=[10 * i + k for k in range(1, 6)],
                              mm_features=[], sampling_params=None, generator=None,
                              block_ids=([i],), num_computed_tokens=5,
                              output_token_ids=[10 * i + 6])
        for i, r in enumerate(ids)
    }  # fmt: skip
    batch = SimpleNamespace(num_reqs=3, req_ids=ids, vocab_size=drafter.vllm_config.model_config
                            .get_vocab_size(), num_tokens_no_spec=np.array([6, 6, 6]))  # fmt: skip
    kwargs: dict[str, Any] = dict(
        sampled_token_ids=torch.tensor(SAMPLED), requests=requests, gpu_input_batch=batch,
        discard_request_mask=torch.tensor(DISCARD),
    )  # fmt: skip
    method = method or drafter.prepare_next_token_ids_padded
    if "common_attn_metadata" in inspect.signature(method).parameters:  # 0.17.x
        kwargs["common_attn_metadata"] = SimpleNamespace(seq_lens_cpu=torch.tensor([5, 5, 5]))
    next_ids, count = method(**kwargs)
    return next_ids.tolist(), count.tolist()


def test_the_release_starts_the_next_step_from_the_first_column(drafter: Any) -> None:
    """Fails first: the release alone returns A's first token (15, not the 18 it
    committed) and counts one for A and for the discarded C."""
    assert prepare(drafter, release_method(drafter)) == FIRST_COLUMN


def test_patched_the_next_step_starts_from_the_last_valid_token(drafter: Any) -> None:
    import vllm_hsfix

    vllm_hsfix.apply()  # as the plugin does in each vLLM process
    assert vllm_hsfix.status()["patches"][ROW.id]["status"] == "applied"
    assert prepare(drafter) == WANT
