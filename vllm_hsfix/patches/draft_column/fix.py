"""``draft-column``: the hidden-states proposer returns one draft token per request,
[B, 1], so the runner's copy into its (max_num_reqs, 1) buffer holds on every decode
step, with penalties or without async scheduling (docs/patches.md; GHSA-83vm-p52w-f9pw).
Goes when: 0.19.x is no longer supported.
"""

from __future__ import annotations

import ast
import inspect
from types import SimpleNamespace
from typing import Any

from ... import checks
from ...shapes import Probe, method
from .._probe import class_def, expect, finds, fingerprints, params, probes
from .._wrap import Replacement, wrap
from ..hooks import Hooks

PATCH_ID = "draft-column"
ATTRIBUTE, METHOD = "ExtractHiddenStatesProposer", "propose"


# The fix, PR 38610's ``sampled_token_ids[:, :1]``: the first column of what the
# release returns is the token the target sampled (0.17.x adds a trailing axis of 1).
def one_column(tokens: Any) -> Any:
    """``tokens`` ([B, k] or [B, k, 1]) as [B, 1]: the target-sampled column."""
    return tokens.reshape(tokens.shape[0], -1)[:, :1]


def _installed(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    out = wrapped(*args, **kwargs)
    if isinstance(out, tuple):  # 0.17.x: (draft tokens, the drafter's connector output)
        return (one_column(out[0]), *out[1:])
    return one_column(out)


def apply(module: Any, shape: str, hooks: Hooks) -> list[Replacement]:
    return [wrap(getattr(module, ATTRIBUTE), METHOD, _installed, PATCH_ID)]


# The gate for code of no tested build: ``propose`` returns the sampled tokens whole
# (0.18-0.19) or unsqueezed beside the connector output (0.17.x), once.
def returned(fn: ast.FunctionDef) -> str:
    """``whole`` or ``unsqueezed`` where ``fn`` has one return, of a known form; else ""."""
    values = [n.value for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]
    if len(values) != 1:
        return ""
    value = values[0]
    if isinstance(value, ast.Name) and value.id == "sampled_token_ids":
        return "whole"
    pair = isinstance(value, ast.Tuple) and len(value.elts) == 2
    if pair and ast.unparse(value.elts[0]) == "sampled_token_ids.unsqueeze(-1)":
        return "unsqueezed"
    return ""


def shape_check(tree: ast.Module) -> Probe:
    fn = method(class_def(tree, ATTRIBUTE), METHOD)
    if fn is None:
        return Probe(None, detail=f"no method {ATTRIBUTE}.{METHOD} in the module")
    if finds(fn, "sampled_token_ids[:, :1]"):
        return Probe(None, fixed=True, detail="the first sampled column only is returned")
    shape = returned(fn)
    return expect(
        shape,
        f"{METHOD} returns every sampled column ({shape})",
        {
            f"{METHOD}(self, sampled_token_ids, ...)": params(fn)[:2]
            == ("self", "sampled_token_ids"),
            "one return of sampled_token_ids, whole or .unsqueeze(-1) beside the connector "
            "output": bool(shape),
        },
    )


TARGET = f"{ATTRIBUTE}.{METHOD}"
probe_tree, probe = probes(
    PATCH_ID, lambda tree: fingerprints(tree, (TARGET,)), shape_check, (TARGET,)
)


def _proposer(cls: type, num_tokens: int, width: int) -> Any:
    """A proposer whose drafter model and attention metadata do nothing: what is
    checked is the tokens ``propose`` hands back, not the hidden states it stores."""
    import torch
    from vllm.config import CUDAGraphMode, VllmConfig

    proposer = object.__new__(cls)
    proposer.__dict__.update(
        vllm_config=VllmConfig(), model=lambda **kw: None, attn_layer_names=[], dp_rank=0,
        num_speculative_tokens=1,
        attn_metadata_builder=SimpleNamespace(build_for_drafting=lambda **kw: None),
        hidden_states=torch.zeros(num_tokens, 2, width),
        _slot_mapping_buffer=torch.zeros(num_tokens, dtype=torch.int64),
        _determine_batch_execution_and_padding=lambda n, *a, **k: (CUDAGraphMode.NONE, n, None),
    )  # fmt: skip
    return proposer


def check_columns(cls: type) -> list[str]:
    """The live ``propose`` on a decode step (2 requests, 2 tokens each, [B, 2] sampled
    tokens): what it returns, copied into a (max_num_reqs, 1) buffer as the runner does,
    must be the target-sampled column."""
    import torch

    sampled = torch.tensor([[11, 12], [21, -1]])
    hidden = [torch.zeros(4, 8), torch.ones(4, 8)]
    kwargs = dict(sampled_token_ids=sampled, target_hidden_states=hidden, slot_mappings=None,
                  common_attn_metadata=SimpleNamespace(slot_mapping=torch.arange(4)))  # fmt: skip
    wanted = inspect.signature(cls.propose).parameters
    if "scheduler_output" in wanted:
        kwargs["scheduler_output"] = None  # 0.17.x: read only with a connector set up
    if "num_speculative_tokens" in wanted:
        kwargs["num_speculative_tokens"] = 1  # 0.24+: what the method is run with
    out = _proposer(cls, 4, 8).propose(**kwargs)
    tokens = out[0] if isinstance(out, tuple) else out
    buffer = torch.zeros(8, 1, dtype=torch.int64)
    try:
        buffer[: tokens.shape[0]].copy_(tokens)
    except RuntimeError as exc:
        return [f"propose returned {tuple(tokens.shape)}: the runner's copy fails ({exc})"]
    want = sampled[:, :1]
    return [] if torch.equal(buffer[:2], want) else [f"copied {buffer[:2].tolist()}"]


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    name = f"{ATTRIBUTE}.{METHOD} returns one draft token per request on a decode step"
    if ctx.shape is None:  # upstream's own propose: its collaborators differ by release
        return [checks.result(name, [], skipped="upstream's propose, not called here")]
    return checks.one(name, lambda: check_columns(getattr(module, ATTRIBUTE)))
