"""What test_gpu.py checks the scatter with: the replacement under test (or a planted
wrong one), the releases' own ``basic_cache``, and a padded batch with byte-exact
expectations built from it."""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_hsfix.patches.hooks import Hooks
from vllm_hsfix.patches.scatter_clamp import fix as scatter

ROOT = Path(__file__).resolve().parent.parent.parent
PLANT_ENV = "VLLM_HSFIX_CHECK_PLANT"
RELEASE_CODE_ENV = "VLLM_HSFIX_RELEASE_CODE"
REQUIRE_ENV = "VLLM_HSFIX_REQUIRE_RELEASE_CODE"

Scatter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]


def _two_d(to_cache: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    block_size = kv_cache.shape[1]
    kv_cache[slots // block_size, slots % block_size] = to_cache


def _plant_wrong_slot(to_cache: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    total = kv_cache.shape[0] * kv_cache.shape[1]
    _two_d(to_cache, kv_cache, (slots.clamp_min(0) + 1) % total)


def _plant_syncs(to_cache: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    if bool((slots < 0).any()):  # a data-dependent branch: the host waits for the device
        slots = slots.clamp_min(0)
    _two_d(to_cache, kv_cache, slots)


PLANTS: dict[str, Scatter] = {
    "unclamped": _two_d,  # the bug itself
    "wrong-slot": _plant_wrong_slot,
    "syncs": _plant_syncs,
}
PLANT = os.environ.get(PLANT_ENV) or None
if PLANT is not None and PLANT not in PLANTS:
    raise ValueError(f"{PLANT_ENV}={PLANT!r}: expected one of {sorted(PLANTS)}")


def replacement(shape: str) -> Scatter:
    """vllm-hsfix's replacement for a recognised shape, or the planted wrong one."""
    return PLANTS[PLANT] if PLANT else scatter.REPLACEMENTS[shape]


# From the README's patch table: the shape each release's basic_cache has.
RELEASE_SHAPES = {"0.17.0": "flat-view", "0.22.0": "2d-index", "0.24.0": "2d-index"}


def load_script(path: Path) -> types.ModuleType:
    """A script that is not in a package, imported by path (once)."""
    if path.stem in sys.modules:
        return sys.modules[path.stem]
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


RELEASE_CODE = load_script(ROOT / "scripts" / "gpu_release_code.py")


def release_dir() -> Path:
    return Path(os.environ.get(RELEASE_CODE_ENV) or RELEASE_CODE.DEFAULT_DEST)


@dataclass
class Release:
    """One release's own ``basic_cache`` in a module of its own, as vLLM's module holds it."""

    version: str
    path: Path
    shape: str | None
    module: types.ModuleType

    @property
    def original(self) -> Scatter:
        return self.module.basic_cache

    def patched(self) -> Scatter:
        """A second module holding the same release function, with vllm-hsfix's
        replacement installed by ``scatter.apply`` (the path the runtime takes)."""
        module = types.ModuleType(f"vllm-{self.version}-patched")
        module.basic_cache = RELEASE_CODE.compile_basic_cache(self.path)  # type: ignore[attr-defined]

        def on_failure(patch_id: str, exc: BaseException) -> None:
            raise AssertionError(f"{patch_id} reported a failure") from exc

        hooks = Hooks(on_failure=on_failure)
        assert self.shape is not None, f"{self.version}: basic_cache's shape is not recognised"
        saved = scatter.REPLACEMENTS[self.shape]
        scatter.REPLACEMENTS[self.shape] = replacement(self.shape)
        try:
            (done,) = scatter.apply(module, self.shape, hooks)
        finally:
            scatter.REPLACEMENTS[self.shape] = saved
        assert done.in_effect() and done.original is not module.basic_cache
        return module.basic_cache  # type: ignore[no-any-return]


def load_release(version: str) -> Release:
    path = RELEASE_CODE.release_file(release_dir(), version)
    if not path.is_file():
        why = f"no {path} (run: python3 scripts/gpu_release_code.py)"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(why)
        pytest.skip(why)
    shape = scatter.probe_tree(ast.parse(path.read_text(), str(path))).shape
    module = types.ModuleType(f"vllm-{version}")
    module.basic_cache = RELEASE_CODE.compile_basic_cache(path)  # type: ignore[attr-defined]
    return Release(version, path, shape, module)


NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD = 8, 16, 3, 64
CAPTURE = 8  # the batch size the graph is captured for; every step is padded to it
LAST = (NUM_BLOCKS - 1, BLOCK_SIZE - 1)  # (block, offset) of the buffer's last slot
STRIDE_PAD = 3  # extra slots per block of a strided view's buffer


@dataclass
class PaddedRun:
    """A KV buffer and three steps of a ``CAPTURE``-row batch: step 1 stores the live token in
    the buffer's last slot; steps 2 and 3 end with 3 and 1 padding rows (slot -1)."""

    base: torch.Tensor  # the whole buffer (a strided view's is wider)
    initial: torch.Tensor  # a copy of it before any step
    kv_cache: torch.Tensor  # what basic_cache gets
    steps: list[tuple[torch.Tensor, torch.Tensor]]  # (rows, slot_mapping)
    live_row: torch.Tensor


def padded_run(device: str, dtype: torch.dtype, strided: bool, seed: int = 0) -> PaddedRun:
    gen = torch.Generator().manual_seed(seed)
    width = BLOCK_SIZE + (STRIDE_PAD if strided else 0)
    base = torch.full((NUM_BLOCKS, width, HEADS, HEAD), 7.0, dtype=dtype).to(device)
    kv_cache = base[:, :BLOCK_SIZE] if strided else base
    last = LAST[0] * BLOCK_SIZE + LAST[1]
    usable = torch.arange(BLOCK_SIZE, last)  # not block 0, not the live last slot
    steps = []
    for n_pad in (0, 3, 1):
        n_real = CAPTURE - n_pad
        real = usable[torch.randperm(usable.numel(), generator=gen)[:n_real]]
        if n_pad == 0:
            real[0] = last  # the live request's token
        slots = torch.cat([real, torch.full((n_pad,), -1, dtype=torch.long)])
        rows = torch.randn(CAPTURE, HEADS, HEAD, generator=gen).to(dtype)
        steps.append((rows.to(device), slots.to(device)))
    return PaddedRun(base, base.clone(), kv_cache, steps, steps[0][0][0].clone())


def run_eager(fn: Scatter, run: PaddedRun) -> list[torch.Tensor]:
    """Call ``fn`` once per step; a copy of the whole buffer after each."""
    out = []
    for rows, slots in run.steps:
        fn(rows, run.kv_cache, slots)
        out.append(run.base.clone())
    return out


def run_graph(fn: Scatter, run: PaddedRun) -> list[torch.Tensor]:
    """Capture ``fn`` once, then replay it per step with the step's rows and slots copied into
    the captured inputs, as vLLM's CUDA-graph runner does; a buffer copy after each replay."""
    static_rows = torch.zeros_like(run.steps[0][0])
    static_slots = torch.full_like(run.steps[0][1], BLOCK_SIZE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(static_rows, run.kv_cache, static_slots)  # warm-up, as capture needs
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(static_rows, run.kv_cache, static_slots)
    run.base.copy_(run.initial)  # forget the warm-up's write
    out = []
    for rows, slots in run.steps:
        static_rows.copy_(rows)
        static_slots.copy_(slots)
        graph.replay()
        out.append(run.base.clone())
    torch.cuda.synchronize()
    return out


def made_of(slot: torch.Tensor, rows: torch.Tensor) -> bool:
    """Every element of ``slot`` equals that element of one of ``rows``: padding rows stored to
    one slot may interleave element by element on CUDA."""
    if rows.shape[0] == 0:
        return False
    return bool((rows.cpu() == slot.cpu().unsqueeze(0)).flatten(1).any(0).all())


def store_problems(
    before: torch.Tensor,
    after: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    padding_slot: tuple[int, int],
    block_size: int,
) -> list[str]:
    """What is wrong with a buffer after one scatter: every byte as before but the real rows'
    slots and ``padding_slot``, which holds its old bytes or padding's."""
    want = before.cpu().clone()
    view = want[:, :block_size]
    for row, slot in zip(rows.cpu(), slots.cpu().tolist(), strict=True):
        if slot >= 0:
            view[slot // block_size, slot % block_size] = row
    got = after.cpu().clone()
    problems = []
    block, offset = padding_slot
    if not (
        torch.equal(got[block, offset], want[block, offset])
        or made_of(got[block, offset], rows[slots < 0])
    ):
        problems.append(f"block {block} slot {offset} holds neither its old bytes nor padding")
    got[block, offset] = want[block, offset]
    changed = torch.nonzero((got != want).flatten(2).any(2)).tolist()
    problems += [f"block {b} slot {o} is not what the real rows leave there" for b, o in changed]
    return problems


def scratch_problems(fn: Callable[..., Any], case: dict[str, torch.Tensor]) -> list[str]:
    """``fn(rows, kv_cache, slots)`` on a ``scatter_clamp.checks.scratch_case``: padding
    may go to the null block's slot 0 only."""
    before = case["base"].clone()
    fn(case["rows"], case["kv_cache"], case["slots"])
    bs = case["kv_cache"].shape[1]
    return store_problems(before, case["base"], case["rows"], case["slots"], (0, 0), bs)


def step_problems(
    run: PaddedRun, got: list[torch.Tensor], padding_slot: tuple[int, int]
) -> list[str]:
    """:func:`store_problems` for every step of a run, each against the one before."""
    problems = []
    before = run.initial
    for i, ((rows, slots), after) in enumerate(zip(run.steps, got, strict=True)):
        problems += [
            f"step {i + 1}: {p}"
            for p in store_problems(before, after, rows, slots, padding_slot, BLOCK_SIZE)
        ]
        before = after
    return problems


def assert_original_overwrites_live_slot(run: PaddedRun, got: list[torch.Tensor]) -> None:
    """The bug: after step 1 the live request's row is in the last slot; after steps 2
    and 3 padding is, and nothing else differs from the real rows' stores."""
    assert torch.equal(got[0][LAST].cpu(), run.live_row.cpu()), "the live row was not stored"
    for step in (1, 2):
        last = got[step][LAST]
        rows, slots = run.steps[step]
        assert made_of(last, rows[slots < 0]), f"step {step + 1}: no padding there"
        assert not torch.equal(last.cpu(), run.live_row.cpu())
    assert step_problems(run, got, LAST) == []


def assert_replacement_keeps_live_slot(run: PaddedRun, got: list[torch.Tensor]) -> None:
    """The fix: the live request's row stays; every byte of the buffer is what the real
    rows' stores leave, but the null block's slot 0, which may take padding."""
    for step in range(3):
        assert torch.equal(got[step][LAST].cpu(), run.live_row.cpu()), (
            f"step {step + 1}: the live request's row in the last slot was overwritten"
        )
    assert step_problems(run, got, (0, 0)) == []
