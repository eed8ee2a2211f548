"""``draft-column`` on the release's own code (issue 57, GHSA-83vm-p52w-f9pw): the real
``ExtractHiddenStatesProposer`` (its drafter model loaded by the release's loader, its KV
cache bound) proposes on a decode step, and the real ``GPUModelRunner`` copy of its
draft tokens into the (max_num_reqs, 1) buffer succeeds, with penalties under async
scheduling and without async scheduling; without the row the copy raises."""

from __future__ import annotations

import contextlib
import importlib
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import CACHE
from support import spec_decode

from vllm_hsfix.patches import by_id

pytestmark = [pytest.mark.needs_vllm, pytest.mark.applies("draft-column")]
ROW = by_id("draft-column")
# A decode step of two requests: each verifies last step's draft token, so the sampler
# returns two columns (-1: the draft was rejected, nothing after the target's token).
SAMPLED = [[11, 12], [21, -1]]
SLOTS = [23, 24, 37, 38]  # block size 16: request 0 in block 1, request 1 in block 2
# Runner settings under which the copy runs: async with a penalty (output_token_ids is
# what a repetition penalty makes the sampling metadata hold), and no async at all.
COPIES = {"async+penalty": (True, [[5, 6]]), "no-async": (False, [])}


@pytest.fixture(scope="module")
def dense() -> Any:
    from hsfix_demo import tiny_model

    return tiny_model.build(CACHE / "models" / "dense", "dense")


def propose(drafter: Any) -> Any:
    """``propose`` as ``GPUModelRunner.propose_draft_token_ids`` calls it on a decode step
    (0.17.x also passes the step's scheduler output and gets a pair back)."""
    import inspect

    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    hidden = drafter.hidden_size
    starts = torch.tensor([0, 2, 4], dtype=torch.int32)
    meta = CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts,
        seq_lens=torch.tensor([9, 7], dtype=torch.int32), num_reqs=2, num_actual_tokens=4,
        max_query_len=2, max_seq_len=9, block_table_tensor=torch.tensor([[1], [2]]),
        slot_mapping=torch.tensor(SLOTS),
    )  # fmt: skip
    states = [torch.full((4, hidden), float(i + 1), dtype=torch.bfloat16) for i in range(2)]
    kwargs = dict(sampled_token_ids=torch.tensor(SAMPLED), target_hidden_states=states,
                  common_attn_metadata=meta, slot_mappings=None)  # fmt: skip
    if "scheduler_output" in inspect.signature(drafter.propose).parameters:
        from vllm.v1.core.sched.output import SchedulerOutput

        kwargs["scheduler_output"] = SchedulerOutput.make_empty()
    out = drafter.propose(**kwargs)
    return out[0] if isinstance(out, tuple) else out


def runner_copy(config: Any, draft: Any, use_async: bool, output_token_ids: list) -> Any:
    """The release's ``GPUModelRunner._copy_draft_token_ids_to_cpu`` and
    ``_get_draft_token_ids_cpu`` on the runner state they read; CUDA's streams and events
    are no-ops here (this machine has no GPU), the copy itself is the release's."""
    import torch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = object.__new__(GPUModelRunner)
    noop = SimpleNamespace(record=lambda *a: None, synchronize=lambda: None,
                           wait_stream=lambda *a: None)  # fmt: skip
    runner.__dict__.update(
        use_async_scheduling=use_async, _draft_token_ids=draft, _draft_token_req_ids=None,
        input_batch=SimpleNamespace(req_ids=["a", "b"], sampling_metadata=SimpleNamespace(
            output_token_ids=output_token_ids)),
        draft_token_ids_event=noop, draft_token_ids_copy_stream=noop,
        draft_token_ids_cpu=torch.zeros((config.scheduler_config.max_num_seqs,
                                         config.speculative_config.num_speculative_tokens),
                                        dtype=torch.int64),
    )  # fmt: skip
    step = SimpleNamespace(has_structured_output_requests=False)
    with _cpu_streams():
        runner._copy_draft_token_ids_to_cpu(step)
    return runner._get_draft_token_ids_cpu()


@contextlib.contextmanager
def _cpu_streams() -> Any:
    import torch

    saved = torch.cuda.current_stream, torch.cuda.stream
    torch.cuda.current_stream = lambda *a: None
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    try:
        yield
    finally:
        torch.cuda.current_stream, torch.cuda.stream = saved


def test_unpatched_release_hands_the_runner_every_column(dense: Any) -> None:
    """Failing first: the release's code as it ships."""
    import vllm_hsfix

    vllm_hsfix.unapply()
    module = importlib.import_module(ROW.module)
    assert getattr(module.ExtractHiddenStatesProposer.propose, "hsfix_patch", None) is None
    drafter, _ = spec_decode.proposer(dense)
    draft = propose(drafter)
    assert draft.shape[:2] == (2, 2)
    for use_async, outputs in COPIES.values():
        with pytest.raises(RuntimeError, match="shape"):
            runner_copy(drafter.vllm_config, draft, use_async, outputs)


@pytest.mark.parametrize("copy", COPIES)
def test_patched_release_proposes_one_token_per_request(
    patched: Any, dense: Any, copy: str
) -> None:
    """The row as the runtime applies it (fails with
    VLLM_HSFIX_DISABLED_PATCHES=draft-column)."""
    import torch

    importlib.import_module(ROW.module)
    assert patched.status()["patches"][ROW.id]["status"] == "applied"
    drafter, kv = spec_decode.proposer(dense)
    draft = propose(drafter)
    assert tuple(draft.shape) == (2, 1)
    tokens, req_ids = runner_copy(drafter.vllm_config, draft, *COPIES[copy])
    assert (tokens, req_ids) == ([[11], [21]], ["a", "b"])
    # The drafter model still stored every token's hidden states in its slots.
    flat = kv.reshape(-1, *kv.shape[2:])
    assert bool((flat[SLOTS][:, 0] == 1).all()) and bool((flat[SLOTS][:, 1] == 2).all())
    assert int(torch.count_nonzero(flat.sum(dim=(1, 2)))) == len(SLOTS)
