"""``allow-chunked-prefill``: an extraction engine starts with chunked prefill, vLLM's
default, where ``slots-from-blocks`` makes a chunked prompt's file right (docs/patches.md).
Goes when: 0.23.x is no longer supported.
"""

from __future__ import annotations

import ast
import logging
from typing import Any

from ... import checks
from ...shapes import Probe, method
from .._probe import class_def, expect, fingerprints, params, probes
from .._wrap import Replacement, wrap
from ..hooks import Hooks

PATCH_ID = "allow-chunked-prefill"
CONFIG, METHOD = "VllmConfig", "_post_init_kv_transfer_config"
CONNECTOR = "ExampleHiddenStatesConnector"
NEEDS = "slots-from-blocks"  # saves each request once, from its own blocks
FLAG = "enable_chunked_prefill"
log = logging.getLogger("vllm_hsfix")


# The fix, upstream's rule (PR 43805, 0.24.0): no refusal once each request is saved
# from its own blocks. The release's method runs whole, its one read of the flag (the
# refusal's) seeing it off; the flag is back on before anything else reads it. Without
# slots-from-blocks in place the refusal stands: a chunked prompt's file would be wrong.
def _installed(hooks: Hooks) -> Any:
    def _post_init_kv_transfer_config(
        wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        kv, sched = instance.kv_transfer_config, instance.scheduler_config
        refused = kv is not None and kv.kv_connector == CONNECTOR and getattr(sched, FLAG)
        if not refused or not hooks.in_place(NEEDS):
            return wrapped(*args, **kwargs)
        object.__setattr__(sched, FLAG, False)
        try:
            result = wrapped(*args, **kwargs)
        finally:
            object.__setattr__(sched, FLAG, True)
        log.info(
            "vllm-hsfix %s: chunked prefill stays on with %s (the release refuses it; "
            "%s saves each request once, from its own blocks, as vLLM 0.24.0 does)",
            PATCH_ID, CONNECTOR, NEEDS,
        )  # fmt: skip
        return result

    return _post_init_kv_transfer_config


def apply(module: Any, shape: str, hooks: Hooks) -> list[Replacement]:
    return [wrap(getattr(module, CONFIG), METHOD, _installed(hooks), PATCH_ID)]


# The gate for code of no tested build: the method's one read of the flag is the
# refusal's test, next to this connector's name, and its body is the raise alone.
SHAPE = "refuses-chunked-prefill"


def _reads(node: ast.AST | None) -> list[ast.Attribute]:
    found = ast.walk(node) if node is not None else ()
    return [n for n in found if isinstance(n, ast.Attribute) and n.attr == FLAG]


def _refusal(fn: ast.AST | None) -> ast.If | None:
    """The ``if`` of ``fn`` whose test reads the flag and names this connector."""
    for node in ast.walk(fn) if fn is not None else ():
        if isinstance(node, ast.If) and _reads(node.test) and CONNECTOR in ast.unparse(node.test):
            return node
    return None


def shape_check(tree: ast.Module) -> Probe:
    cls = class_def(tree, CONFIG)
    if cls is not None and _refusal(cls) is None:
        return Probe(None, fixed=True, detail=f"{CONFIG} does not refuse {CONNECTOR}")
    fn = method(cls, METHOD)
    refusal = _refusal(fn)
    wanted = {
        f"{CONFIG}.{METHOD}(self)": params(fn) == ("self",),
        f"an if reading {FLAG} beside {CONNECTOR!r}, whose body is one raise": (
            refusal is not None
            and len(refusal.body) == 1
            and isinstance(refusal.body[0], ast.Raise)
            and not refusal.orelse
        ),
        f"{FLAG} read once, by that if": len(_reads(fn)) == 1,
    }
    return expect(SHAPE, f"{CONFIG} refuses {CONNECTOR} with chunked prefill", wanted)


probe_tree, probe = probes(
    PATCH_ID,
    lambda tree: fingerprints(tree, (METHOD,), CONFIG),
    shape_check,
    (f"{CONFIG}.{METHOD}",),
)


def check_refusal(module: Any, in_place: bool) -> list[str]:
    """The LIVE config class, built for this connector with chunked prefill on (no
    model): built, the flag still on, where slots-from-blocks is in place; else refused."""
    sched = module.SchedulerConfig(max_model_len=256, is_encoder_decoder=False, **{FLAG: True})
    kv = module.KVTransferConfig(kv_connector=CONNECTOR, kv_role="kv_producer")
    try:
        built, refused = getattr(module, CONFIG)(scheduler_config=sched, kv_transfer_config=kv), ""
    except ValueError as exc:  # pydantic's ValidationError carries the release's message
        built, refused = None, str(exc)
    if in_place and (built is None or not getattr(built.scheduler_config, FLAG)):
        return [f"refused or changed with {NEEDS} in place: {refused or FLAG + ' left off'}"]
    if not in_place and built is not None:
        return [f"chunked prefill let through without {NEEDS}"]
    return []


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    name = f"{CONFIG}.{METHOD}: chunked prefill allowed where {NEEDS} is in place"
    if ctx.shape is None:  # 0.24.0 on: no refusal
        return [checks.result(name, [], skipped=f"vLLM {ctx.version}: not applied here")]
    return checks.one(name, lambda: check_refusal(module, True))
