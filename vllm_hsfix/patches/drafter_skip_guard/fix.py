"""``drafter-skip-guard``: no step of an extraction engine skips its hidden-states
writer because one request was padded up to ``max_model_len`` (docs/patches.md). Goes
when: 0.28.x is no longer supported.
"""

from __future__ import annotations

import ast
import logging
from types import SimpleNamespace
from typing import Any

from ... import checks
from ...shapes import Probe, method
from .._probe import class_def, expect, fingerprints, params, probes
from .._wrap import Replacement, arg, wrap
from ..hooks import Hooks

PATCH_ID = "drafter-skip-guard"
SCHEDULER, MANAGER = "Scheduler", "KVCacheManager"
INIT, SCHEDULE, HITS = "__init__", "schedule", "get_computed_blocks"
LENGTHS = "_hsfix_skip_lengths"  # on the scheduler's KV cache manager
METHOD = "extract_hidden_states"
log = logging.getLogger("vllm_hsfix")


# The fix. The release pads a new request with one token left to compute to
# 1 + n tokens (n speculative) when m + 1 + n <= max_model_len, m its prefix-cache
# hit; the drafter then needs m + 1 + 2n <= max_model_len, so hits m in
# [L - 2n, L - n - 1] skip it. Upstream (0.29.0) leaves such a request unpadded; here
# the hit is not used, the prompt is computed whole and no padding happens at all.
def skip_lengths(max_model_len: int, num_spec: int) -> range:
    """The prefix-cache hits whose one-token remainder is padded into a drafter skip."""
    return range(max(1, max_model_len - 2 * num_spec), max_model_len - num_spec)


def _installed_init() -> Any:
    def __init__(
        wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        wrapped(*args, **kwargs)
        spec = getattr(instance.vllm_config, "speculative_config", None)
        n = int(getattr(instance, "num_spec_tokens", 0) or 0)
        if getattr(spec, "method", None) == METHOD and n > 0:
            lengths = skip_lengths(int(instance.max_model_len), n)
            instance.kv_cache_manager.__dict__[LENGTHS] = lengths

    return __init__


def _installed_hits() -> Any:
    said: list[bool] = []

    def get_computed_blocks(
        wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        blocks, hit = wrapped(*args, **kwargs)
        lengths = instance.__dict__.get(LENGTHS)
        request = arg(args, kwargs, 0, "request")
        if not lengths or hit not in lengths or request.num_tokens - hit != 1:
            return blocks, hit
        if not said:  # one line per engine: what was done, and why
            said.append(True)
            log.info(
                "vllm-hsfix %s: a prefix-cache hit of %d of %d tokens is not used (vLLM "
                "would pad the request to max_model_len and skip the hidden-states writer "
                "for its whole step, PR 53962); such prompts are computed whole",
                PATCH_ID, hit, request.num_tokens,
            )  # fmt: skip
        return instance.empty_kv_cache_blocks, 0

    return get_computed_blocks


def apply(module: Any, shape: str, hooks: Hooks) -> list[Replacement]:
    return [
        wrap(getattr(module, SCHEDULER), INIT, _installed_init(), PATCH_ID),
        wrap(getattr(module, MANAGER), HITS, _installed_hits(), PATCH_ID),
    ]


# The gate for code of no tested build: schedule pads a one-token new request to the
# speculative length bounded by max_model_len alone (0.29.0 adds the sampled token).
SHAPE = "pad-to-max-model-len"
KEPT = ("max_model_len", "num_spec_tokens", "kv_cache_manager")


def _padding(schedule: ast.AST | None) -> ast.If | None:
    """The ``if`` of ``schedule`` that sets ``pad_spec_decode = True``."""
    found = None
    for node in ast.walk(schedule) if schedule is not None else ():
        if isinstance(node, ast.If) and "pad_spec_decode = True" in ast.unparse(node):
            found = node  # the innermost one: ast.walk goes outside in
    return found


def _room_for_sampled(node: ast.AST) -> bool:
    """0.29.0's bound: a comparison of max_model_len with the sampled tokens counted."""
    text = ast.unparse(node) if isinstance(node, ast.Compare) else ""
    return "num_sampled_tokens_per_step" in text and "max_model_len" in text


def shape_check(tree: ast.Module) -> Probe:
    cls = class_def(tree, SCHEDULER)
    schedule, init = method(cls, SCHEDULE), method(cls, INIT)
    pad = _padding(schedule)
    if schedule is not None and pad is None:
        return Probe(None, fixed=True, detail=f"{SCHEDULE} pads no new request")
    if pad is not None and any(_room_for_sampled(n) for n in ast.walk(pad)):
        return Probe(None, fixed=True, detail="padding leaves room for the sampled token")
    body = ast.unparse(schedule) if schedule is not None else ""
    wanted = {
        f"{SCHEDULER}.{SCHEDULE} pads to 1 + num_spec_tokens bounded by max_model_len": (
            pad is not None and "self.max_model_len" in ast.unparse(pad)
        ),
        f"{SCHEDULE} reads hits with self.kv_cache_manager.{HITS}(request)": (
            f"self.kv_cache_manager.{HITS}(request)" in body
        ),
        f"{SCHEDULER}.{INIT}(self, vllm_config, ...) keeping max_model_len, num_spec_tokens": (
            params(init)[:2] == ("self", "vllm_config")
            and all(f"self.{a} =" in ast.unparse(init) for a in KEPT)
        ),
    }
    return expect(SHAPE, "a new decode request padded up to max_model_len", wanted)


probe_tree, probe = probes(
    PATCH_ID,
    lambda tree: fingerprints(tree, (INIT, SCHEDULE), SCHEDULER),
    shape_check,
    (f"{SCHEDULER}.{INIT}",),
)


def check_hits(cls: type) -> list[str]:
    """The LIVE manager method, on a hit of 64 with max_model_len 66 and one speculative
    token: unused for a 65-token prompt (64 + 2 fits, 64 + 3 does not), kept for 66."""
    manager = cls.__new__(cls)
    empty = object()
    manager.__dict__.update(
        enable_caching=True, log_stats=False, empty_kv_cache_blocks=empty,
        coordinator=SimpleNamespace(find_longest_cache_hit=lambda hashes, n: (["b"], 64)),
        create_kv_cache_blocks=lambda blocks: blocks, **{LENGTHS: skip_lengths(66, 1)},
    )  # fmt: skip
    got = []
    for tokens in (65, 66):
        request = SimpleNamespace(num_tokens=tokens, skip_reading_prefix_cache=False,
                                  block_hashes=[], num_preemptions=0)  # fmt: skip
        got.append(getattr(cls, HITS)(manager, request))
    want = [(empty, 0), (["b"], 64)]
    return [] if got == want else [f"got {got}, expected {want}"]


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    name = f"{MANAGER}.{HITS}: a hit padded into a drafter skip is not used"
    if ctx.shape is None:  # 0.29.0 on: upstream pads only with room left
        return [checks.result(name, [], skipped=f"vLLM {ctx.version}: not applied here")]
    return checks.one(name, lambda: check_hits(getattr(module, MANAGER)))
