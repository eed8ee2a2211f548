"""``tp-rank-zero-writes``: one writer per file under tensor parallelism, rank 0, as
0.24.0 has it (docs/patches.md). Goes when: 0.23.x is no longer supported.
"""

from __future__ import annotations

import ast
from typing import Any

from ... import checks
from ...shapes import Probe, method
from .._probe import calls, class_def, expect, fingerprints, params, probes
from .._wrap import Replacement, wrap
from ..hooks import Hooks

PATCH_ID = "tp-rank-zero-writes"
ATTRIBUTE = "ExampleHiddenStatesConnector"
SAVE = "save_kv_layer"
RANK_ZERO = "_hsfix_tp_rank_zero"  # read once, after distributed init (first save)


# The fix, upstream's rule: a rank other than tensor-parallel rank 0 saves nothing (its
# hidden states are the same rows; it reports its requests done, as 0.24.0's do).
def tp_rank() -> int | None:
    """This process's tensor-parallel rank; None before vLLM set up its groups (a save
    outside an engine, e.g. ``vllm-hsfix verify``: a lone process, which writes)."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    return int(ps.get_tensor_model_parallel_rank())


def _installed_save() -> Any:
    def save_kv_layer(
        wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        zero = instance.__dict__.get(RANK_ZERO)
        if zero is None:
            rank = tp_rank()
            zero = rank in (None, 0)
            if rank is not None:  # read once the groups exist, as 0.24.0 does
                instance.__dict__[RANK_ZERO] = zero
        return wrapped(*args, **kwargs) if zero else None

    return save_kv_layer


def apply(module: Any, shape: str, hooks: Hooks) -> list[Replacement]:
    return [wrap(getattr(module, ATTRIBUTE), SAVE, _installed_save(), PATCH_ID)]


# The gate for code of no tested build: a save that writes (0.17-0.21: save_file in the
# step) or queues a write (0.22-0.23: _pending_copies), with no rank check of its own.
SHAPE = "every-rank-saves"
RANK_WORDS = ("get_tensor_model_parallel_rank", "_is_tp_rank_zero")


def shape_check(tree: ast.Module) -> Probe:
    cls = class_def(tree, ATTRIBUTE)
    save = method(cls, SAVE)
    if cls is not None and any(word in ast.unparse(cls) for word in RANK_WORDS):
        return Probe(None, fixed=True, detail=f"{ATTRIBUTE} checks the tensor-parallel rank")
    source = ast.unparse(save) if save is not None else ""
    writes = any(c.endswith("save_file") for c in calls(save)) or "_pending_copies" in source
    wanted = {
        f"{ATTRIBUTE}.{SAVE}(self, layer_name, kv_layer, attn_metadata, **kwargs)": (
            params(save)[:4] == ("self", "layer_name", "kv_layer", "attn_metadata")
        ),
        f"{SAVE} writes (save_file) or queues a write (_pending_copies)": writes,
    }
    return expect(SHAPE, "every rank saves", wanted)


probe_tree, probe = probes(
    PATCH_ID,
    lambda tree: fingerprints(tree, (SAVE,), ATTRIBUTE),
    shape_check,
    (ATTRIBUTE + "." + SAVE,),
)


def check_ranks(cls: type) -> list[str]:
    """The LIVE save on rank 1 returns without reaching the release's save."""
    conn = cls.__new__(cls)
    conn.__dict__[RANK_ZERO] = False
    try:  # the release's save would read its layers and metadata: none are set here
        got = cls.save_kv_layer(conn, "hsfix-layer", None, None)
    except Exception as exc:
        return [f"rank 1 reached the release's save: {exc!r}"]
    return [] if got is None else [f"rank 1's save returned {got!r}"]


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    name = f"{ATTRIBUTE}.{SAVE}: a tensor-parallel rank other than 0 saves nothing"
    if ctx.shape is None:  # 0.24.0 on: the release's own rank check
        return [checks.result(name, [], skipped=f"vLLM {ctx.version}: not applied here")]
    return checks.one(name, lambda: check_ranks(getattr(module, ATTRIBUTE)))
