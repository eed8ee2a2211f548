"""The checks that prove the fix is live, run on the patched code by the patches'
``verify`` and ``in_situ`` (and the tests). torch and vLLM load inside functions only.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from .releases import reached

MODEL_MODULE = "vllm.model_executor.models.extract_hidden_states"


@dataclass(frozen=True)
class Context:
    """What a patch's ``verify`` gets: the device, the installed release, and the shape
    the patch recognised (None when it was not applied)."""

    device: str
    version: str | None
    shape: str | None = None


def result(name: str, problems: list[str], **extra: Any) -> dict[str, Any]:
    """One check's row as ``verify`` reports it (``extra``: ``skipped``, ``ms``, ...)."""
    return {"check": name, "ok": not problems, "problems": problems, **extra}


def one(name: str, run: Any) -> list[dict[str, Any]]:
    """One check as ``verify`` reports it: ``run()`` lists problems; an exception is a
    problem too, never a crash of ``verify``."""
    try:
        problems = list(run())
    except Exception as exc:
        problems = [f"check could not run: {exc!r}"]
    return [result(name, problems)]


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1e3, 3)


def scratch_case(
    *,
    device: str,
    dtype: Any,
    num_blocks: int = 6,
    block_size: int = 8,
    heads: int = 3,
    head: int = 16,
    strided: bool = False,
    padding: int = 5,
    seed: int = 0,
) -> dict[str, Any]:
    """A scratch cache, rows to scatter and a slot mapping with ``-1`` padding mixed in.
    Real slots avoid block 0 (the null block) and the buffer's last slot (where an
    unclamped ``-1`` lands), so both misbehaviours show as changed bytes."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    pad_rows = 3 if strided else 0
    base = torch.full((num_blocks, block_size + pad_rows, heads, head), 7.0, dtype=dtype)
    base = base.to(device)
    kv_cache = base[:, :block_size] if strided else base
    usable = torch.arange(block_size, num_blocks * block_size - 1)
    n_real = min(2 * block_size + 3, usable.numel())
    real = usable[torch.randperm(usable.numel(), generator=gen)[:n_real]]
    slots = torch.cat([real, torch.full((padding,), -1, dtype=torch.long)])
    order = torch.randperm(slots.numel(), generator=gen)
    slots = slots[order].to(device)
    rows = torch.randn(slots.numel(), heads, head, generator=gen).to(dtype).to(device)
    return {"base": base, "kv_cache": kv_cache, "slots": slots, "rows": rows}


def check_scatter(fn: Any, case: dict[str, Any]) -> list[str]:
    """Call ``fn(rows, kv_cache, slots)`` and list what is wrong afterwards: each real
    row must sit in its slot, the null block's slot 0 be untouched or hold a padding
    row, and nothing else in the underlying buffer (strided view included) change."""
    import torch

    base, kv_cache, slots, rows = case["base"], case["kv_cache"], case["slots"], case["rows"]
    before = base.clone()
    before_view = kv_cache.clone()
    fn(rows, kv_cache, slots)
    problems: list[str] = []
    nb, bs = kv_cache.shape[0], kv_cache.shape[1]
    flat_after = kv_cache.reshape(nb * bs, *kv_cache.shape[2:])
    flat_before = before_view.reshape(nb * bs, *kv_cache.shape[2:])
    real = slots >= 0
    real_slots = slots[real]
    if not torch.equal(flat_after[real_slots], rows[real]):
        wrong = (flat_after[real_slots] != rows[real]).flatten(1).any(1).sum().item()
        problems.append(f"{wrong} of {int(real.sum())} real rows are not in their slots")
    written = torch.zeros(nb * bs, dtype=torch.bool, device=kv_cache.device)
    written[real_slots] = True
    written[0] = True
    untouched = ~written
    if not torch.equal(flat_after[untouched], flat_before[untouched]):
        changed = (
            torch.nonzero((flat_after != flat_before).flatten(1).any(1) & untouched)
            .flatten()
            .tolist()
        )
        where = ", ".join(f"block {s // bs} slot {s % bs}" for s in changed[:4])
        problems.append(f"padding or stray writes changed {len(changed)} slot(s): {where}")
    pad_rows = rows[~real]
    slot0 = flat_after[0]
    # Padding rows stored to one slot may interleave element by element on CUDA.
    made_of_padding = pad_rows.shape[0] > 0 and bool(
        (pad_rows == slot0.unsqueeze(0)).flatten(1).any(0).all()
    )
    if not torch.equal(slot0, flat_before[0]) and not made_of_padding:
        problems.append("the null block's slot 0 holds something other than a padding row")
    if kv_cache.data_ptr() != base.data_ptr() or kv_cache.shape != base.shape:
        # Strided view: the bytes outside the view must be untouched as well.
        outside = torch.ones(base.shape[:2], dtype=torch.bool, device=base.device)
        outside[:, :bs] = False
        if not torch.equal(base[outside], before[outside]):
            problems.append("bytes outside the strided view changed")
    return problems


def head_major(fn: Any) -> Any:
    """Adapt a 0.29+ ``basic_cache`` (``[blocks, heads, block_size, head]``) to the
    checks' ``[blocks, block_size, heads, head]`` cache, through a transposed view."""

    def call(to_cache: Any, kv_cache: Any, slot_mapping: Any) -> Any:
        return fn(to_cache, kv_cache.transpose(1, 2), slot_mapping)

    return call


def live_scatter(module: Any, version: str | None) -> Any:
    """The live ``basic_cache``, adapted to the buffer layout of the installed release."""
    if version is not None and reached(version, "0.29.0"):  # heads moved before block_size
        return head_major(module.basic_cache)
    return module.basic_cache


def scatter_checks(fn: Any, device: str, shape: str | None) -> list[dict[str, Any]]:
    """The scatter check over dtypes and layouts the installed release supports."""
    import torch

    results = []
    layouts = [False, True] if shape != "flat-view" else [False]
    for dtype in ("bfloat16", "float32"):
        for strided in layouts:
            case = scratch_case(device=device, dtype=getattr(torch, dtype), strided=strided)
            t0 = time.perf_counter()
            problems = check_scatter(fn, case)
            layout = "strided view" if strided else "contiguous"
            results.append(result(f"scatter {dtype} {layout}", problems, ms=_ms(t0)))
    return results


def cuda_checks(fn: Any) -> list[dict[str, Any]]:
    """No host sync inside the scatter; capture in a CUDA graph, replay with new inputs."""
    return [
        *one("no host-device sync", lambda: _no_host_sync(fn)),
        *one("CUDA graph capture and replay", lambda: _graph_replay(fn)),
    ]


def _no_host_sync(fn: Any) -> list[str]:
    import torch

    case = scratch_case(device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    try:
        torch.cuda.set_sync_debug_mode("error")
        fn(case["rows"], case["kv_cache"], case["slots"])
    except RuntimeError as exc:
        return [f"the scatter synchronised the host: {exc}"]
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return []


def _graph_replay(fn: Any) -> list[str]:
    import torch

    static = scratch_case(device="cuda", dtype=torch.bfloat16, seed=1)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    problems: list[str] = []
    try:
        with torch.cuda.stream(stream):
            fn(static["rows"], static["kv_cache"], static["slots"])  # warm-up
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            fn(static["rows"], static["kv_cache"], static["slots"])
        for seed in (2, 3):
            # New inputs in the captured tensors: a correct graph scatters them too.
            fresh = scratch_case(device="cuda", dtype=torch.bfloat16, seed=seed)
            for key in ("base", "rows", "slots"):
                static[key].copy_(fresh[key])
            replayed = check_scatter(lambda *_: graph.replay(), static)
            problems += [f"replay with seed {seed}: {p}" for p in replayed]
        torch.cuda.synchronize()
    except Exception as exc:
        problems.append(f"CUDA graph capture/replay failed: {exc!r}")
    return problems


def hybrid_layout() -> tuple[Any, dict[str, int]]:
    """A Qwen3.5-A3B-like hybrid ``KVCacheConfig`` from vLLM's own classes: attention
    and mamba at block size 528, the hidden-states group (not first) at its own 22."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        HiddenStateCacheSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    groups = [
        KVCacheGroupSpec(
            ["model.layers.3.self_attn"],
            FullAttentionSpec(block_size=528, num_kv_heads=2, head_size=256, dtype=torch.bfloat16),
        ),
        KVCacheGroupSpec(
            ["model.layers.0.linear_attn"],
            MambaSpec(block_size=528, shapes=((4, 8),), dtypes=(torch.float32,)),
        ),
        KVCacheGroupSpec(
            ["cache_only_layers.0"],
            HiddenStateCacheSpec(
                block_size=22, num_kv_heads=3, head_size=2048, dtype=torch.bfloat16
            ),
        ),
    ]
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
    return config, {"group": 2, "block_size": 22, "global_block_size": 528}


def construct_connector(cls: type, kv_cache_config: Any, global_block_size: int) -> Any:
    """An instance of ``cls`` built through its live ``__init__`` (worker role), from the
    parts of a ``VllmConfig`` the constructor reads."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    draft = SimpleNamespace(hf_config=SimpleNamespace(eagle_aux_hidden_state_layer_ids=[1, 2]))
    with tempfile.TemporaryDirectory(prefix="vllm-hsfix-check-") as storage:
        transfer = KVTransferConfig(
            kv_connector="ExampleHiddenStatesConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": storage},
        )
        config = SimpleNamespace(
            kv_transfer_config=transfer,
            cache_config=SimpleNamespace(block_size=global_block_size),
            speculative_config=SimpleNamespace(draft_model_config=draft),
        )
        conn = cls(vllm_config=config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config)
    executor = getattr(conn, "_executor", None)
    if executor is not None:
        executor.shutdown(wait=False)
    return conn


def hidden_group(connector: Any) -> Any:
    """The hidden-states group a connector reads: upstream's ``_cache_kv_group_id``,
    else 0.24.0's ``_hs_group_idx`` (None: neither is set)."""
    group = getattr(connector, "_cache_kv_group_id", None)
    return getattr(connector, "_hs_group_idx", None) if group is None else group


def connector_checks(cls: Any, version: str | None, first: str) -> list[dict[str, Any]]:
    """The live connector class ``cls`` resolves a hybrid layout to the hidden group's
    own block size (skipped before release ``first``, the hidden-group-block-size
    row's: releases before it never read with it)."""
    name = "connector group / block size (hybrid: 528, 528, hidden 22)"
    if version is None or not reached(version, first):
        why = f"vLLM {version}: the connector does not read with its block size before {first}"
        return [result(name, [], skipped=why)]
    config, want = hybrid_layout()
    problems: list[str] = []
    try:
        conn = construct_connector(cls, config, want["global_block_size"])
    except Exception as exc:
        return [result(name, [f"construction failed: {exc!r}"])]
    got = {"group": hidden_group(conn), "block_size": conn._block_size}
    expected = {"group": want["group"], "block_size": want["block_size"]}
    if got != expected:
        problems.append(f"resolved {got}, expected {expected}")
    return [result(name, problems, resolved=got)]


def in_situ_scatter(fn: Any, buffer: Any) -> dict[str, Any] | None:
    """Check ``fn`` on a scratch cache shaped like ``buffer`` (None: not a 4-D buffer)."""
    if buffer is None or buffer.dim() != 4:
        return None
    try:
        t0 = time.perf_counter()
        case = scratch_case(
            device=str(buffer.device),
            dtype=buffer.dtype,
            num_blocks=3,
            block_size=min(int(buffer.shape[1]), 8),
            heads=int(buffer.shape[2]),
            head=int(buffer.shape[3]),
            strided=not buffer.is_contiguous(),
            padding=2,
        )
        problems = check_scatter(fn, case)
        return {
            "ok": not problems,
            "problems": problems,
            "device": str(buffer.device),
            "dtype": str(buffer.dtype).replace("torch.", ""),
            "ms": _ms(t0),
        }
    except Exception as exc:
        return {"ok": False, "problems": [f"check could not run: {exc!r}"]}


def check_aux_capture(model_cls: type, num_layers: int = 4) -> list[str]:
    """Call the live ``DeepseekV2Model.forward`` on a small stand-in model (one pipeline
    rank) asking for aux ids ``1, 2, num_layers``: each must be its own layer's state
    (the input of layers 1 and 2, the last layer's output before the norm)."""
    import types

    import torch

    forward = model_cls.__dict__["forward"]
    rank = SimpleNamespace(is_first_rank=True, is_last_rank=True)
    glb = {**forward.__globals__, "get_pp_group": lambda: rank}
    fn = types.FunctionType(forward.__code__, glb, "forward", forward.__defaults__)

    def layer(i: int) -> Any:
        def run(positions: Any, h: Any, r: Any, *rest: Any, **kw: Any) -> Any:
            r = h if r is None else h + r
            return r * 0.5 + (i + 1), r

        run.use_sequence_parallel_moe = False  # type: ignore[attr-defined]
        return run

    layers = [layer(i) for i in range(num_layers)]
    ids = torch.arange(3)
    model = SimpleNamespace(
        config=SimpleNamespace(),
        layers=layers,
        start_layer=0,
        end_layer=num_layers,
        aux_hidden_state_layers=(1, 2, num_layers),
        hidden_size=1,
        embed_input_ids=lambda x: x.float()[:, None],
        norm=lambda h, r: (h + r, h + r),
    )
    out = fn(model, ids, ids, None)
    h, r, want = ids.float()[:, None], None, []
    for i, f in enumerate(layers):
        if i in (1, 2):
            want.append(h + r)
        h, r = f(ids, h, r)
    want.append(h + r)
    got = out[1] if isinstance(out, tuple) else []
    if len(got) != len(want):
        return [f"{len(got)} aux states for {len(want)} ids"]
    return [
        f"aux slot {k} is not its layer's state"
        for k, (g, w) in enumerate(zip(got, want, strict=True))
        if not torch.equal(g, w)
    ]
