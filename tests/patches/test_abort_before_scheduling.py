"""``abort-before-scheduling`` without an engine: its gate on one-line edits of 0.24.0's
connector, and the live connector class failing without the patch and passing with it.
Engine level: tests/e2e/test_hazards_e2e.py and test_hazards_serve.py."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from conftest import INSTALL, NO_HOOKS, connector
from support.skeletons import probe_edited

from vllm_hsfix import checks
from vllm_hsfix.patches._wrap import ours_in, wrap
from vllm_hsfix.patches.abort_before_scheduling import fix as abort_unscheduled

# ---------------------------------------------------------------------------
# The shape gate on changed files


# One-line edits of 0.24.0's connector: (old, new, whether the gate must call the result
# fixed upstream); never a shape it patches.
VARIANTS = {
    # the connector half of the fix alone: the crash moves to the scheduler's assert
    "pop with a default only": (
        "filename = self._request_filenames.pop(req_id)",
        "filename = self._request_filenames.pop(req_id, None)",
        False,
    ),
    # a metadata class that cannot carry the mark to the workers
    "metadata with slots": (
        "@dataclass\nclass ExampleHiddenStatesConnectorMetadata",
        "@dataclass(slots=True)\nclass ExampleHiddenStatesConnectorMetadata",
        False,
    ),
    # a request that never holds its blocks
    "request_finished returns False": (
        'return True, {"hidden_states_path": filename}',
        'return False, {"hidden_states_path": filename}',
        False,
    ),
    # the worker no longer reports requests without a copy (upstream's worker half)
    "get_finished reports copies only": (
        "if event is None or event.query():",
        "if event is not None and event.query():",
        False,
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_changed_connector_is_not_patched(variant: str) -> None:
    old, new, fixed = VARIANTS[variant]
    got = probe_edited(abort_unscheduled, old, new)
    assert got.shape is None and got.fixed is fixed, (variant, got)  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------
# The live class of the installed vLLM


def _switch_all(cls: type, on: bool) -> list[Any]:
    """Our wrappers on ``cls`` (activation on import may have put them there) set to
    ``on``; returns them, so the caller can put their state back."""
    found = [
        ours_in(cls.__dict__.get(m), abort_unscheduled.PATCH_ID) for m in abort_unscheduled.METHODS
    ]
    present = [w for w in found if w is not None]
    for w in present:
        w.hsfix_set_active(on)
    return present


@pytest.mark.needs_vllm
@pytest.mark.fixed_upstream("abort-before-scheduling")
def test_live_class_check_passes_on_upstreams_fix() -> None:
    cls = connector().ExampleHiddenStatesConnector
    present = _switch_all(cls, False)
    try:
        assert abort_unscheduled.check_abort(cls) == []
    finally:
        for w in present:
            w.hsfix_set_active(True)


@pytest.mark.needs_vllm
@pytest.mark.applies("abort-before-scheduling")
def test_live_class_check_fails_without_the_patch_and_passes_with_it() -> None:
    """The release's own methods (any wrapper of ours switched off) fail the check; the
    connector half alone fails it too; the patch passes it and ``verify`` says so."""
    module = connector()
    cls = module.ExampleHiddenStatesConnector
    present = _switch_all(cls, False)  # put back on at the end: activation had them on
    try:
        before = abort_unscheduled.check_abort(cls)
        assert len(before) == 1 and "KeyError" in before[0], before
        half = wrap(cls, "request_finished", abort_unscheduled.decline_unknown, "test-half")
        try:
            only_half = abort_unscheduled.check_abort(cls)
        finally:
            half.restore()
        assert len(only_half) == 1 and "get_finished reports" in only_half[0], only_half
        shape = abort_unscheduled.probe(module).shape
        assert shape == abort_unscheduled.SHAPE
        # Activation's own wrappers when there are (switched on), else apply here.
        reps = [] if _switch_all(cls, True) else abort_unscheduled.apply(module, shape, NO_HOOKS)
        try:
            assert abort_unscheduled.check_abort(cls) == []
            ctx = checks.Context(device="cpu", version=INSTALL.version, shape=shape)
            assert all(r["ok"] for r in abort_unscheduled.verify(module, ctx))
        finally:
            for rep in reversed(reps):
                rep.restore()
        _switch_all(cls, False)
        assert abort_unscheduled.check_abort(cls) == before
    finally:
        for w in present:
            w.hsfix_set_active(True)


@pytest.mark.needs_vllm
@pytest.mark.applies("abort-before-scheduling")
def test_the_mark_travels_with_the_metadata() -> None:
    """The multiprocessing executor pickles the scheduler output to the workers."""
    module = connector()
    meta = module.ExampleHiddenStatesConnectorMetadata()
    setattr(meta, abort_unscheduled.DECLINED_IDS, frozenset({"r1"}))
    back = pickle.loads(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL))
    assert getattr(back, abort_unscheduled.DECLINED_IDS) == frozenset({"r1"})
