"""``next-token-last-valid``: after an accepted draft, the next step starts from the
token the sampler committed last (docs/patches.md). Goes when: upstream's fix (PR 56442)
is in every supported release.
"""

from __future__ import annotations

import ast
import inspect
from typing import Any

from ... import checks
from ...shapes import Probe, method
from .._probe import class_def, expect, finds, fingerprints, params, probes
from .._wrap import Replacement, wrap
from ..hooks import Hooks

PATCH_ID = "next-token-last-valid"
ATTRIBUTE = "ExtractHiddenStatesProposer"
PREPARE = "prepare_next_token_ids_padded"
SAMPLED, BATCH, DISCARD = "sampled_token_ids", "gpu_input_batch", "discard_request_mask"


# The fix, EAGLE's rule (PR 56442): per row, the last valid token (in [0, vocab)) and the
# number of valid ones; a discarded request counts none and takes its backup token. The
# release's own method still picks the backup tokens: it gets the last valid token as
# its one column, and its count is replaced.
def last_valid(sampled: Any, vocab_size: int) -> tuple[Any, Any]:
    """Each row's last valid token (-1 where none is) and its count of valid tokens."""
    import torch

    valid = (sampled >= 0) & (sampled < vocab_size)
    count = valid.sum(dim=1, dtype=torch.int32)
    columns = torch.arange(sampled.shape[1], device=sampled.device)
    last = torch.where(valid, columns, -1).amax(dim=1)
    token = sampled.gather(1, last.clamp(min=0).unsqueeze(1)).squeeze(1)
    return torch.where(count > 0, token, torch.full_like(token, -1)), count


def _installed(sig: inspect.Signature) -> Any:
    """``sig``: the release's method without ``self`` (0.17.x takes one argument more),
    read once at apply rather than at every step."""

    def prepare(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        import torch

        bound = sig.bind(*args, **kwargs)
        sampled, batch = bound.arguments[SAMPLED], bound.arguments[BATCH]
        token, count = last_valid(sampled, batch.vocab_size)
        bound.arguments[SAMPLED] = token.unsqueeze(1)
        next_ids, _ = wrapped(*bound.args, **bound.kwargs)
        discarded = bound.arguments[DISCARD][: count.shape[0]]
        return next_ids, torch.where(discarded, torch.zeros_like(count), count)

    return prepare


def apply(module: Any, shape: str, hooks: Hooks) -> list[Replacement]:
    cls = getattr(module, ATTRIBUTE)
    sig = inspect.signature(getattr(cls, PREPARE))
    sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    return [wrap(cls, PREPARE, _installed(sig), PATCH_ID)]


# The gate for code of no tested build: the method reads the first column only.
SHAPE = "first-column"


def shape_check(tree: ast.Module) -> Probe:
    prep = method(class_def(tree, ATTRIBUTE), PREPARE)
    if prep is not None and not finds(prep, f"{SAMPLED}[:, 0]"):
        return Probe(None, fixed=True, detail=f"{PREPARE} does not read column 0 alone")
    names = params(prep)
    wanted = {
        f"{ATTRIBUTE}.{PREPARE}(self, ..., {SAMPLED}, requests, {BATCH}, {DISCARD})": (
            all(n in names for n in (SAMPLED, "requests", BATCH, DISCARD))
        ),
        f"{PREPARE} reads {SAMPLED}[:, 0] and {BATCH}.vocab_size": (
            finds(prep, f"{BATCH}.vocab_size")
        ),
        f"{PREPARE} returns (next token ids, valid count)": (
            finds(prep, "(next_token_ids, valid_sampled_tokens_count)")
        ),
    }
    return expect(SHAPE, "only the first sampled column read", wanted)


probe_tree, probe = probes(
    PATCH_ID,
    lambda tree: fingerprints(tree, (PREPARE,), ATTRIBUTE),
    shape_check,
    (f"{ATTRIBUTE}.{PREPARE}",),
)


def check_rows() -> list[str]:
    """The rule on worked rows (vocab 100): an accepted draft, a rejected one, none."""
    import torch

    token, count = last_valid(torch.tensor([[15, 18], [21, -1], [-1, -1], [7, 100]]), 100)
    got = (token.tolist(), count.tolist())
    want = ([18, 21, -1, 7], [2, 1, 0, 1])
    return [] if got == want else [f"got {got}, expected {want}"]


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    name = f"{ATTRIBUTE}.{PREPARE}: the last valid sampled token, every valid one counted"
    if ctx.shape is None:
        return [checks.result(name, [], skipped=f"vLLM {ctx.version}: not applied here")]
    return checks.one(name, check_rows)
