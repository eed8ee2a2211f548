"""The connector's group / block-size resolution with vLLM's own config objects."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import MODEL_MODULE, connector
from support.extraction import kv_transfer_config, speculative_config
from support.serve import free_port

from vllm_hsfix.patches import by_id
from vllm_hsfix.patches.hidden_group_block_size import fix as patch


def _has_hidden_spec() -> bool:
    try:
        return hasattr(
            importlib.import_module("vllm.v1.kv_cache_interface"), "HiddenStateCacheSpec"
        )
    except ImportError:
        return False


HAS_HIDDEN_SPEC = _has_hidden_spec()
# Selected by the table, never by vllm-hsfix's own report: where the row applies, a
# silent non-application must fail.
needs_connector_patch = pytest.mark.applies("hidden-group-block-size")
pytestmark = pytest.mark.needs_vllm
needs_hidden_spec = pytest.mark.skipif(
    not HAS_HIDDEN_SPEC,
    reason="HiddenStateCacheSpec only exists from vLLM 0.22; the connector patch is 0.24-only",
)


def specs() -> Any:
    return importlib.import_module("vllm.v1.kv_cache_interface")


def full(bs: int = 528) -> Any:
    return specs().FullAttentionSpec(
        block_size=bs, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
    )


def hidden(bs: int = 22, heads: int = 3, head: int = 256) -> Any:
    return specs().HiddenStateCacheSpec(
        block_size=bs, num_kv_heads=heads, head_size=head, dtype=torch.bfloat16
    )


def mamba(bs: int = 528) -> Any:
    return specs().MambaSpec(block_size=bs, shapes=((4, 8),), dtypes=(torch.float32,))


def layout(*group_specs: Any) -> Any:
    k = specs()
    groups = [
        k.KVCacheGroupSpec(
            [
                f"model.layers.{i}.x"
                if not isinstance(s, k.HiddenStateCacheSpec)
                else "cache_only_layers.0"
            ],
            s,
        )
        for i, s in enumerate(group_specs)
    ]
    return k.KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


LAYOUTS = {
    "hidden group not first (528 vs 22)": (lambda: layout(full(), hidden(22), full()), 1, 22),
    "hybrid with mamba, hidden last": (lambda: layout(mamba(), full(), hidden(85)), 2, 85),
    "hidden group bigger than the others": (lambda: layout(full(128), hidden(256)), 1, 256),
    "single non-hidden group": (lambda: layout(full(16)), 0, 16),
    "single hidden group": (lambda: layout(hidden(16)), 0, 16),
}


@needs_hidden_spec
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_group_and_block_size_found_by_spec_type(name: str) -> None:
    make, group, block = LAYOUTS[name]
    cfg = make()
    assert patch.find_hidden_group(cfg) == group
    assert patch.group_block_size(None, cfg, group) == block


def test_no_config_falls_back_to_group_zero_and_the_global_block_size() -> None:
    from types import SimpleNamespace

    vcfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=528))
    assert patch.find_hidden_group(None) == 0
    assert patch.group_block_size(vcfg, None, 0) == 528


@needs_hidden_spec
@pytest.mark.parametrize(
    ("make", "count"),
    [(lambda: layout(full(), mamba()), 0), (lambda: layout(hidden(), full(), hidden()), 2)],
    ids=["none hidden among two", "two hidden groups"],
)
def test_ambiguous_layouts_raise_naming_the_groups(make: Any, count: int) -> None:
    with pytest.raises(ValueError) as err:
        patch.find_hidden_group(make())
    msg = str(err.value)
    assert f"{count} HiddenStateCacheSpec group(s) among" in msg
    assert "0: " in msg and "1: " in msg and "block_size=" in msg
    assert "MLA verifiers are unsupported" in msg


@needs_hidden_spec
@pytest.mark.fixed_upstream("hidden-group-block-size")
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_same_answers_as_upstreams_own_fix(name: str) -> None:
    cls = connector().ExampleHiddenStatesConnector
    cfg = LAYOUTS[name][0]()
    assert patch.find_hidden_group(cfg) == cls._find_cache_kv_group_id(cfg)


@pytest.fixture(scope="module")
def vllm_config(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    out = tmp_path_factory.mktemp("hs")
    # Before 0.22 the connector is not SupportsHMA: hybrids are rejected, use the dense model.
    kind = "hybrid" if HAS_HIDDEN_SPEC else "dense"
    args = EngineArgs(
        model=str(tiny_models[kind]),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=256,
        # The connector refuses chunked prefill; vLLM's CPU platform turns it on by
        # default where the CPU has no AMX.
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        **(
            {"mamba_ssm_cache_dtype": "float32", "language_model_only": True}
            if kind == "hybrid"
            else {}
        ),
        speculative_config=speculative_config([1, 3]),
        kv_transfer_config=kv_transfer_config(str(out)),
    )
    vc = args.create_engine_config()
    vc.cache_config.block_size = 528  # what a hybrid verifier's global value looks like
    return vc


def _roles() -> Any:
    return importlib.import_module(
        "vllm.distributed.kv_transfer.kv_connector.v1.base"
    ).KVConnectorRole


@needs_connector_patch
@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_real_connector_uses_the_hidden_groups_block_size(
    patched: Any, vllm_config: Any, role: str
) -> None:
    cls = connector().ExampleHiddenStatesConnector
    conn = cls(vllm_config, getattr(_roles(), role), layout(full(), hidden(22), mamba()))
    assert patched.status()["patches"]["hidden-group-block-size"]["status"] == "applied"
    assert (conn._hs_group_idx, conn._block_size) == (1, 22)
    conn._executor.shutdown(wait=False)


@needs_connector_patch
def test_verify_checks_the_connector_on_a_pre_release_plan_patches(patched: Any) -> None:
    """0.24.0rc1 is in the row's range for ``plan``, so ``verify`` checks the connector there."""
    from vllm_hsfix.patches.hidden_group_block_size import checks as connector_checks

    cls, first = connector().ExampleHiddenStatesConnector, by_id(patch.PATCH_ID).first
    (got,) = connector_checks.connector_checks(cls, "0.24.0rc1", first)
    assert "skipped" not in got and got["ok"], got


@needs_connector_patch
def test_unpatched_024_connector_shows_the_bug(vllm_config: Any) -> None:
    import vllm_hsfix

    vllm_hsfix.unapply()
    module = connector()
    conn = module.ExampleHiddenStatesConnector(
        vllm_config, _roles().WORKER, layout(full(), hidden(22), mamba())
    )
    assert conn._block_size == 528  # the global value: the 0.24.0 bug
    conn._executor.shutdown(wait=False)


@pytest.fixture(scope="module")
def distributed(vllm_config: Any) -> Any:
    """A one-process gloo world, so the connector's real register_kv_caches can run."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    port = free_port()
    with set_current_vllm_config(vllm_config):
        ps.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo",
        )
        ps.initialize_model_parallel(1, 1)
        layer = importlib.import_module(MODEL_MODULE).CacheOnlyAttentionLayer(
            num_heads=3, head_size=256, prefix="cache_only_layers.0"
        )
    return layer


# A buffer in the hidden-states group's layout with its block size is taken; another
# block size is named; 0.29's head-major layout ([blocks, heads, block_size, head])
# under 0.24's connector is named as such, not as a plain size mismatch.
BUFFERS = {
    "block-22": ((4, 22, 3, 256), None),
    "block-528": ((4, 528, 3, 256), "block dimension 528"),
    "block-16": ((4, 16, 3, 256), "block dimension 16"),
    "head-major": ((4, 3, 22, 256), r"head-major .*\(4, 3, 22, 256\)|22, 256\) is head-major"),
}


@needs_connector_patch
@pytest.mark.parametrize("name", list(BUFFERS))
def test_register_kv_caches_checks_the_buffer(
    patched: Any, vllm_config: Any, distributed: Any, name: str
) -> None:
    module = connector()
    assert patched.status()["patches"]["hidden-group-block-size"]["status"] == "applied"
    conn = module.ExampleHiddenStatesConnector(
        vllm_config, _roles().WORKER, layout(full(), hidden(22), mamba())
    )
    shape, error = BUFFERS[name]
    buffer = torch.zeros(*shape, dtype=torch.bfloat16)
    try:
        if error is None:
            conn.register_kv_caches({"cache_only_layers.0": buffer})
            assert conn._kv_cache is buffer and conn._hs_group_idx == 1
        else:
            with pytest.raises(ValueError, match=error):
                conn.register_kv_caches({"cache_only_layers.0": buffer})
    finally:
        conn._executor.shutdown(wait=False)


@needs_connector_patch
def test_request_finished_all_groups_hands_over_the_hidden_groups_blocks(
    patched: Any, vllm_config: Any
) -> None:
    module = connector()
    cls = module.ExampleHiddenStatesConnector
    assert patched.status()["patches"]["hidden-group-block-size"]["status"] == "applied"
    conn = cls(vllm_config, _roles().SCHEDULER, layout(full(), hidden(22), mamba()))
    seen: list[Any] = []
    conn.request_finished = lambda request, block_ids: seen.append(block_ids) or (False, None)
    conn.request_finished_all_groups(object(), ([1, 2], [7, 8], [3]))
    assert seen == [[7, 8]]
    conn._executor.shutdown(wait=False)


@pytest.mark.applies("scatter-clamp")
@pytest.mark.skipif(HAS_HIDDEN_SPEC, reason="covered with hybrid layouts from 0.22 on")
@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_pre_022_connector_constructs_untouched_with_real_configs(
    patched: Any, vllm_config: Any, role: str
) -> None:
    """0.17-0.21: only the clamp applies; the connector is the release's own and reads
    with the one group's (global) block size, which is right there."""
    k = specs()
    cls = connector().ExampleHiddenStatesConnector
    assert getattr(cls.__dict__["__init__"], "hsfix_patch", None) is None
    spec = k.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    cfg = k.KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[k.KVCacheGroupSpec(["model.layers.0.x"], spec)],
    )
    conn = cls(vllm_config, getattr(_roles(), role), cfg)
    assert conn._block_size == vllm_config.cache_config.block_size
    rec = patched.status()["patches"]
    assert rec["hidden-group-block-size"]["code"] == "not-needed"
    assert rec["scatter-clamp"]["status"] == "applied"
    executor = getattr(conn, "_executor", None)
    if executor is not None:
        executor.shutdown(wait=False)
