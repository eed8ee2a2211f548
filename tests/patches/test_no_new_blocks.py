"""``no-new-blocks`` on the release's own code (issue 57): 0.17.x's connector, built on
an extraction engine's config, takes the step after a request's prompt, in which the
scheduler lists it as running with no new block (``new_block_ids`` None, what a decode
step inside its last block gets); without the row, AssertionError."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
from conftest import CACHE
from support import spec_decode

from vllm_hsfix.patches import by_id
from vllm_hsfix.patches.no_new_blocks.fix import _build

pytestmark = [pytest.mark.needs_vllm, pytest.mark.applies("no-new-blocks")]
ROW = by_id("no-new-blocks")
PROMPT = list(range(20))  # block size 16: two blocks, room for 12 more tokens in the second


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm.config import KVTransferConfig

    from hsfix_demo import tiny_model

    storage = tmp_path_factory.mktemp("hidden-states")
    transfer = KVTransferConfig(
        kv_connector="ExampleHiddenStatesConnector",
        kv_role="kv_producer",
        kv_connector_extra_config={"shared_storage_path": str(storage)},
    )
    path = tiny_model.build(CACHE / "models" / "dense", "dense")
    return spec_decode.engine_config(path, kv_transfer_config=transfer, block_size=16)


def scheduler_connector(config: Any) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    module = importlib.import_module(ROW.module)
    return module.ExampleHiddenStatesConnector(vllm_config=config, role=KVConnectorRole.SCHEDULER)


def steps() -> list[Any]:
    """The scheduler's outputs for one request: its prompt (new, blocks 1 and 2), then
    two decode steps inside block 2 (running, no new block)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    new = _build(NewRequestData, req_id="r", prompt_token_ids=PROMPT, block_ids=([1, 2],),
                 num_computed_tokens=0, sampling_params=SamplingParams(max_tokens=8))  # fmt: skip
    outs = [_build(SchedulerOutput, scheduled_new_reqs=[new],
                   scheduled_cached_reqs=CachedRequestData.make_empty(),
                   num_scheduled_tokens={"r": len(PROMPT)},
                   total_num_scheduled_tokens=len(PROMPT))]  # fmt: skip
    for n in (len(PROMPT), len(PROMPT) + 1):
        cached = _build(CachedRequestData, req_ids=["r"], new_block_ids=[None], new_token_ids=[[7]],
                        num_computed_tokens=[n], num_output_tokens=[1])  # fmt: skip
        outs.append(_build(SchedulerOutput, scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={"r": 1},
                           total_num_scheduled_tokens=1))  # fmt: skip
    return outs


def test_unpatched_release_dies_on_the_first_decode_step(engine: Any) -> None:
    """Failing first: the release's code as it ships."""
    import vllm_hsfix

    vllm_hsfix.unapply()
    conn = scheduler_connector(engine)
    assert getattr(type(conn).build_connector_meta, "hsfix_patch", None) is None
    prompt, decode, _ = steps()
    conn.build_connector_meta(prompt)
    with pytest.raises(AssertionError):
        conn.build_connector_meta(decode)


def test_patched_release_takes_a_running_request_without_new_blocks(
    patched: Any, engine: Any, tmp_path: Path
) -> None:
    """The row as the runtime applies it (fails with
    VLLM_HSFIX_DISABLED_PATCHES=no-new-blocks): the prompt step records the request, the
    decode steps record nothing new, and the scheduler's outputs are left as they were."""
    assert patched.status()["patches"][ROW.id]["status"] == "applied"
    conn = scheduler_connector(engine)
    prompt, *decodes = steps()
    first = conn.build_connector_meta(prompt)
    assert [r.req_id for r in first.requests] == ["r"]
    for out in decodes:
        meta = conn.build_connector_meta(out)
        assert meta.requests == []
        assert out.scheduled_cached_reqs.req_ids == ["r"]
        assert out.scheduled_cached_reqs.new_block_ids == [None]
    assert conn._req_blocks["r"] == [1, 2]
