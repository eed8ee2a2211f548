"""``scatter-clamp``'s checks: the live ``basic_cache`` on scratch caches with padding
(``verify``), on a copy shaped like the worker's buffer (``in_situ``), and on CUDA no
host sync and CUDA-graph capture and replay."""

from __future__ import annotations

import sys
import time
from typing import Any

from ... import checks
from ...checks import result
from ...releases import reached

MODEL_MODULE = "vllm.model_executor.models.extract_hidden_states"
# From this release on the buffer is [blocks, heads, block_size, head] (heads first).
HEAD_MAJOR_FROM = "0.29.0"


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
    if version is not None and reached(version, HEAD_MAJOR_FROM):  # heads moved before block_size
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
        *checks.one("no host-device sync", lambda: _no_host_sync(fn)),
        *checks.one("CUDA graph capture and replay", lambda: _graph_replay(fn)),
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


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    """The live ``basic_cache`` on scratch caches with padding: real rows land, padding
    goes to the null block only, nothing else changes; on CUDA also no host sync and
    CUDA-graph capture and replay."""
    fn = live_scatter(module, ctx.version)
    results = scatter_checks(fn, ctx.device, ctx.shape)
    if ctx.device == "cuda":
        results += cuda_checks(fn)
    return results


def in_situ(connector: Any) -> dict[str, Any] | None:
    """The scatter check on a scratch copy of the buffer the worker just registered."""
    model = sys.modules.get(MODEL_MODULE)
    if model is None:
        return None
    return in_situ_scatter(model.basic_cache, getattr(connector, "_kv_cache", None))
