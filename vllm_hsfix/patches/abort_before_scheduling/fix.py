"""``abort-before-scheduling``: aborting a request never scheduled does not kill the
engine (docs/patches.md). Goes when: 0.30.x is no longer supported.
"""

from __future__ import annotations

import ast
import os
from types import SimpleNamespace
from typing import Any

from ... import checks
from ...shapes import Probe, assigned_attributes, method
from .._probe import class_def, expect, finds, fingerprints, params, probes
from .._wrap import Replacement, add, arg, wrap
from ..hooks import Hooks

PATCH_ID = "abort-before-scheduling"
ATTRIBUTE = "ExampleHiddenStatesConnector"
METADATA = "ExampleHiddenStatesConnectorMetadata"
FILENAMES = "_request_filenames"
# Beyond upstream: the scheduler names the requests it declined in the step's metadata
# (pickled to the workers), which never report those (the scheduler would assert).
DECLINED = "_hsfix_declined"  # on a scheduler-side connector, until the next metadata
DECLINED_IDS = "hsfix_declined_ids"  # on a metadata object: those, for the workers
UNREPORTED = "_hsfix_unreported"  # on a worker-side connector, until they finish here
METHODS = ("request_finished", "build_connector_meta", "get_finished")
ALL_GROUPS = "request_finished_all_groups"
SHAPE = "pop-without-default"
ADDED = "get_finished_count"
FINISHED_COUNT = 1


# The fix, upstream's: request_finished declines a request with no file name; get_finished
# reports only requests whose copy it tracked; get_finished_count() -> 1; no block table
# for the group in request_finished_all_groups is (False, None). Differences: the
# release's request_finished stays for a request it knows (wrapped); get_finished calls
# the release's _submit_async_write; the group is _cache_kv_group_id, else _hs_group_idx.
def decline_unknown(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The installed ``request_finished``: a request never scheduled has no file and
    holds no blocks; decline it instead of raising ``KeyError``."""
    req_id = str(arg(args, kwargs, 0, "request").request_id)
    if req_id in getattr(instance, FILENAMES):
        return wrapped(*args, **kwargs)
    # As upstream: nothing can be pending for it; drop it should anything be.
    instance._pending_saves.pop(req_id, None)
    instance.__dict__.setdefault(DECLINED, set()).add(req_id)
    return False, None


def name_declined(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The installed ``build_connector_meta``: the release's, plus the ids declined."""
    meta = wrapped(*args, **kwargs)
    declined = instance.__dict__.pop(DECLINED, None)
    if declined:
        setattr(meta, DECLINED_IDS, frozenset(declined))
    return meta


def _installed_get_finished(module: Any) -> Any:
    def get_finished(
        wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Upstream's: launch the step's saves, then report the finished requests whose
        copy is done; one without a copy, or declined, is forgotten, not reported."""
        finished_req_ids = arg(args, kwargs, 0, "finished_req_ids")
        unreported: set[str] = instance.__dict__.setdefault(UNREPORTED, set())
        if instance.has_connector_metadata():
            meta = instance._get_connector_metadata()
            if isinstance(meta, getattr(module, METADATA)):
                for pending in meta.pending_saves:
                    instance._submit_async_write(pending)
            unreported.update(getattr(meta, DECLINED_IDS, ()))
        accumulated = instance._accumulated_finished_req_ids
        accumulated.update(finished_req_ids)
        done: set[str] = set()
        for req_id in list(accumulated):
            event = instance._req_copy_events.get(req_id)
            if event is not None and not event.query():
                continue  # the copy is still in flight
            instance._req_copy_events.pop(req_id, None)
            accumulated.discard(req_id)
            if event is not None and req_id not in unreported:
                done.add(req_id)
            unreported.discard(req_id)
            lock_fd = instance._lock_fds.pop(req_id, None)
            if lock_fd is not None:  # a lock made for a request never saved
                os.close(lock_fd)
        return done or None, None

    return get_finished


def guard_missing_group(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Upstream's ``request_finished_all_groups``: no group block table is a no-op."""
    request = arg(args, kwargs, 0, "request")
    block_ids = arg(args, kwargs, 1, "block_ids")
    group = checks.hidden_group(instance)
    if not 0 <= group < len(block_ids):
        return False, None
    return instance.request_finished(request, block_ids[group])


def get_finished_count(self: Any) -> int:
    return FINISHED_COUNT  # upstream's: one report per request (TP rank 0 saves)


def apply(module: object, shape: str, hooks: Hooks) -> list[Replacement]:
    cls = getattr(module, ATTRIBUTE)
    return [
        wrap(cls, "request_finished", decline_unknown, PATCH_ID),
        wrap(cls, "build_connector_meta", name_declined, PATCH_ID),
        wrap(cls, "get_finished", _installed_get_finished(module), PATCH_ID),
        wrap(cls, ALL_GROUPS, guard_missing_group, PATCH_ID),
        add(cls, ADDED, get_finished_count, PATCH_ID),
    ]


# The gate for code of no tested build: 0.24.0-0.30.x's connector, whose request_finished
# pops without a default and whose get_finished reports requests without a copy.
READS = "_submit_async_write _accumulated_finished_req_ids _req_copy_events _lock_fds"
_REPORTS_ANY = "_ is None or _.query()"


def shape_check(tree: ast.Module) -> Probe:
    cls = class_def(tree, ATTRIBUTE)
    finished, build, get, init, all_groups, added = (
        method(cls, name) for name in (*METHODS, "__init__", ALL_GROUPS, ADDED)
    )
    fixed = finds(finished, f"self.{FILENAMES}.pop(_, _)") and not finds(get, _REPORTS_ANY)
    if fixed and finds(get, "_ is not None"):
        detail = "request_finished pops with a default and get_finished reports saved only"
        return Probe(None, fixed=True, detail=f"{detail} (vLLM PR 56841)")
    init_sets = assigned_attributes(init) if init else set()
    meta = class_def(tree, METADATA)
    wanted = {
        f"class {ATTRIBUTE}": cls is not None,
        f"request_finished(self, request, block_ids) pops self.{FILENAMES}[request id] "
        "without a default and holds the request (returns True, ...)": (
            params(finished) == ("self", "request", "block_ids")
            and finds(finished, f"self.{FILENAMES}.pop(_)")
            and finds(finished, "(True, _)")
        ),
        f"__init__ sets self.{FILENAMES} and self._pending_saves": (
            {f"self.{FILENAMES}", "self._pending_saves"} <= init_sets
        ),
        "build_connector_meta records file names for scheduled_new_reqs": (
            finds(build, "scheduler_output.scheduled_new_reqs")
            and finds(build, f"self.{FILENAMES}[_]")
        ),
        "get_finished(self, finished_req_ids) reports requests without a copy in flight, "
        f"reading self.has_connector_metadata and {READS}": (
            params(get) == ("self", "finished_req_ids")
            and finds(get, _REPORTS_ANY)
            and all(finds(get, f"self.{n}") for n in [*READS.split(), "has_connector_metadata"])
        ),
        f"{METADATA} is a plain @dataclass, no slots (takes an attribute, pickles it)": (
            meta is not None
            and [ast.unparse(d) for d in meta.decorator_list] == ["dataclass"]
            and not finds(meta, "__slots__")
        ),
        f"{ATTRIBUTE} defines no {ADDED} (the base class's answers None)": added is None,
        f"{ALL_GROUPS}(self, request, block_ids)": (
            params(all_groups) == ("self", "request", "block_ids")
        ),
    }
    return expect(SHAPE, "request_finished raises KeyError unscheduled", wanted)


def _fingerprints(tree: ast.Module) -> dict[str, str]:
    # The methods, and the __init__ state and metadata class the replacement relies on.
    fps = fingerprints(tree, (*METHODS, ALL_GROUPS, "__init__"), ATTRIBUTE)
    return {**fps, **fingerprints(tree, (METADATA,))}


OWN = tuple(f"{ATTRIBUTE}.{m}" for m in (*METHODS, ALL_GROUPS))
probe_tree, probe = probes(PATCH_ID, _fingerprints, shape_check, OWN)


def check_abort(cls: type) -> list[str]:
    """Drive the LIVE class through an abort before scheduling, both roles on one
    instance: a scheduled request stays held; one never scheduled is declined, unreported."""
    config, want = checks.hybrid_layout()
    conn = checks.construct_connector(cls, config, want["global_block_size"])
    kept = SimpleNamespace(req_id="hsfix-scheduled", sampling_params=None)
    conn.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[kept]))
    tokens = {"kv_transfer_params": None, "prompt_token_ids": [1, 2, 3], "all_token_ids": [1, 2, 3]}
    held = conn.request_finished(SimpleNamespace(request_id="hsfix-scheduled", **tokens), [1])
    problems = []
    if held[0] is not True or not (held[1] or {}).get("hidden_states_path"):
        problems.append(f"a scheduled request is no longer held with its file: got {held}")
    never = "hsfix-never-scheduled"
    try:
        declined = conn.request_finished(SimpleNamespace(request_id=never, **tokens), [])
    except Exception as exc:
        return [*problems, f"request_finished on a request never scheduled raised {exc!r}"]
    if declined[0]:
        problems.append(f"request_finished holds a request it has no file for: got {declined}")
    meta = conn.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[]))
    meta.pending_saves = []  # the worker half without the save (that needs a real cache)
    conn.bind_connector_metadata(meta)
    try:
        sending, _ = conn.get_finished({never})
    finally:
        conn.clear_connector_metadata()
    if sending and never in sending:
        problems.append("get_finished reports the declined request (the scheduler asserts)")
    return problems


def check_interface(cls: type) -> list[str]:
    """Upstream's answers on a bare instance, as vLLM's own tests build it."""
    conn = cls.__new__(cls)
    empty = ("_request_filenames", "_pending_saves", "_lock_fds", "_req_copy_events")
    conn.__dict__.update({name: {} for name in empty}, _cache_kv_group_id=2)
    conn.__dict__.update(_connector_metadata=None, _accumulated_finished_req_ids=set())
    never = SimpleNamespace(request_id="hsfix-never", kv_transfer_params=None)
    got = [
        ("get_finished_count()", conn.get_finished_count(), FINISHED_COUNT),
        ("get_finished({never})", conn.get_finished({"hsfix-never"}), (None, None)),
        (
            "request_finished_all_groups(never, ([], []))",
            conn.request_finished_all_groups(never, ([], [])),
            (False, None),
        ),
    ]
    return [f"{call} = {v!r}, expected {w!r}" for call, v, w in got if v != w]


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    cls = getattr(module, ATTRIBUTE)
    name = f"{ATTRIBUTE}: abort of a request never scheduled (declined, not reported)"
    interface = f"{ATTRIBUTE}: upstream's get_finished_count, untracked and missing-group answers"
    return [
        *checks.one(name, lambda: check_abort(cls)),
        *checks.one(interface, lambda: check_interface(cls)),
    ]
