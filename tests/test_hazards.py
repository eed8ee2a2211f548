"""The hazard register and the ``abort-before-scheduling`` patch, without an engine.

* the register is well formed and agrees with the patch table;
* ``assess`` on releases chosen by hand (expected states written here, not computed);
* the shape gate on the real connector files of every release on this machine, and on
  one-line variants of 0.24.0's (each must be refused: the crash would stay or move);
* on the installed vLLM (0.24.0+): the live connector class driven through an abort
  before scheduling fails without the patch (KeyError) and with only its connector
  half (the declined request is still reported), and passes patched; the metadata's
  mark survives pickling, as on the way to a worker process.

The ``atomic-writes`` patch (a writer killed mid-write): test_hazards_atomic.py. The
engine-level evidence is in test_hazards_e2e.py.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from conftest import CONNECTOR_MODULE, INSTALL
from packaging.version import Version
from support.skeletons import RELEASES, connector_file

from vllm_hsfix import checks, hazards
from vllm_hsfix.patches import PATCH_IDS, by_id
from vllm_hsfix.patches import abort_before_scheduling as abort_unscheduled
from vllm_hsfix.patches._wrap import ours_in, wrap
from vllm_hsfix.patches.hooks import Hooks
from vllm_hsfix.shapes import parse, probe_file

# What each release's connector is, for this patch: read off the files by hand
# (request_finished's pop and get_finished's report), independent of the probe.
KNOWN = {
    **dict.fromkeys(RELEASES[:7], "not-this-shape"),  # 0.17-0.23
    **dict.fromkeys(RELEASES[7:14], abort_unscheduled.SHAPE),  # 0.24-0.30
    **dict.fromkeys(RELEASES[14:], "fixed"),  # 0.31-0.33
}


# ---------------------------------------------------------------------------
# The register


def test_register_rows_are_complete() -> None:
    assert len(set(hazards.HAZARD_IDS)) == len(hazards.HAZARDS)
    for h in hazards.HAZARDS:
        assert h.action in hazards.ACTIONS, h.id
        assert h.loses in (hazards.PROCESS, hazards.DATA), h.id
        assert h.trigger and h.effect and h.upstream and h.why_action and h.measured, h.id
        assert h.evidence and all(e.strip() for e in h.evidence), h.id
        if h.action == hazards.PATCH:
            assert h.patch in PATCH_IDS, h.id
        if h.action == hazards.REFUSE_CONFIG:
            assert h.setting, h.id
        if h.action == hazards.DOCUMENTED:
            assert h.workaround, f"{h.id}: a documented hazard tells the user what to do"


LAST_READ = "0.33.0"  # the newest release whose files were read for the register


def test_a_patched_hazard_covers_exactly_its_patch_rows_releases() -> None:
    """Same first release; same fixed release, or, where upstream has no fix, a patch
    row that stops after the last release read (a later one is left alone until read)."""
    for h in hazards.HAZARDS:
        if h.action == hazards.PATCH:
            p = by_id(h.patch)
            assert h.first == p.first, h.id
            if h.fixed_in is None:
                assert Version(p.fixed_in) > Version(LAST_READ), h.id
            else:
                assert (h.fixed_in, h.releases) == (p.fixed_in, p.releases), h.id


@pytest.mark.parametrize(
    ("hazard", "release", "affected"),
    [
        ("abort-before-scheduling", "0.23.0", False),
        ("abort-before-scheduling", "0.24.0", True),
        ("abort-before-scheduling", "0.30.0", True),
        ("abort-before-scheduling", "0.31.0", False),
        ("abort-before-scheduling", "0.24.1.dev3+gabc", True),
        ("drafter-skip", "0.24.0", False),
        ("drafter-skip", "0.25.1", True),
        ("drafter-skip", "0.28.0", True),
        ("drafter-skip", "0.29.0", False),
        ("prefix-cache-slicing", "0.21.0", False),
        ("prefix-cache-slicing", "0.22.1", True),
        ("prefix-cache-slicing", "0.23.0", True),
        ("prefix-cache-slicing", "0.24.0", False),
        ("aux-final-layer-dropped", "0.17.0", False),
        ("aux-final-layer-dropped", "0.18.0", True),
        ("aux-final-layer-dropped", "0.24.0", True),
        ("aux-final-layer-dropped", "0.25.0", False),
        ("torn-files", "0.21.0", False),
        ("torn-files", "0.22.0", True),
        ("torn-files", "0.33.0", True),
        ("torn-files-in-step", "0.16.0", False),
        ("torn-files-in-step", "0.17.0", True),
        ("torn-files-in-step", "0.21.0", True),
        ("torn-files-in-step", "0.22.0", False),
        # vLLM's CPU GDN op on AMX: 0.21.0 has no AMX branch, 0.26.0 guards the width.
        ("cpu-amx-gdn-conv-state", "0.21.0", False),
        ("cpu-amx-gdn-conv-state", "0.22.0", True),
        ("cpu-amx-gdn-conv-state", "0.24.0", True),
        ("cpu-amx-gdn-conv-state", "0.25.1", True),
        ("cpu-amx-gdn-conv-state", "0.26.0", False),
        ("cpu-amx-gdn-conv-state", "0.33.0", False),
    ],
)
def test_affected_releases(hazard: str, release: str, affected: bool) -> None:
    assert hazards.by_id(hazard).affects(release) is affected


@pytest.mark.parametrize(
    ("release", "codes", "state"),
    [
        ("0.23.0", {}, "not-affected"),
        ("0.24.0", {"abort-before-scheduling": "would-apply"}, "patched"),
        ("0.24.0", {"abort-before-scheduling": "applied"}, "patched"),
        ("0.24.0", {"abort-before-scheduling": "unknown-shape"}, "open"),
        ("0.24.0", {"abort-before-scheduling": "disabled"}, "open"),
        ("0.31.0", {"abort-before-scheduling": "upstream-fix-present"}, "fixed-upstream"),
        (None, {}, "unknown"),
    ],
)
def test_assess_a_patched_hazard(release: str | None, codes: dict[str, str], state: str) -> None:
    got = hazards.assess(hazards.by_id("abort-before-scheduling"), release, codes)
    assert got["state"] == state, got
    assert got["action"] == "patch"


def test_assess_a_documented_hazard() -> None:
    torn = hazards.by_id("torn-files-in-step")
    assert hazards.assess(torn, "0.20.0", {})["state"] == "exposed"
    assert hazards.assess(torn, "0.20.0", {})["reason"] == torn.workaround
    assert hazards.assess(torn, "0.22.0", {})["state"] == "not-affected"  # ended, not fixed
    assert hazards.assess(torn, "not a version", {})["state"] == "unknown"
    every = hazards.assess_all("0.25.0", {"abort-before-scheduling": "would-apply"})
    assert set(every) == set(hazards.HAZARD_IDS)


@pytest.mark.parametrize(
    ("release", "codes", "state"),
    [
        ("0.17.0", {}, "not-affected"),
        ("0.18.0", {"aux-final-layer": "would-apply"}, "patched"),
        ("0.24.0", {"aux-final-layer": "applied"}, "patched"),
        ("0.24.0", {"aux-final-layer": "unknown-shape"}, "open"),
        ("0.24.0", {"aux-final-layer": "disabled"}, "open"),
        ("0.25.0", {"aux-final-layer": "upstream-fix-present"}, "fixed-upstream"),
    ],
)
def test_the_final_aux_layer_hazard_is_patched_on_0_18_to_0_24(
    release: str, codes: dict[str, str], state: str
) -> None:
    """PR 46973's hazard: 0.18.0-0.24.x (0.17.0 captures no aux states on the backbone),
    patched by ``aux-final-layer``, fixed upstream in 0.25.0."""
    h = hazards.by_id("aux-final-layer-dropped")
    assert (h.action, h.patch, h.first, h.fixed_in) == (
        "patch",
        "aux-final-layer",
        "0.18.0",
        "0.25.0",
    )
    assert hazards.assess(h, release, codes)["state"] == state


def test_assess_the_cpu_amx_gdn_hazard() -> None:
    """Patched by ``cpu-gdn-wide-conv-state``, a dead process otherwise, only GDN hybrids
    on vLLM's CPU build with AMX (the status line says so through ``models``); 0.22-0.25,
    fixed in 0.26.0; not affected where the patch is not needed (the CUDA wheel)."""
    h = hazards.by_id("cpu-amx-gdn-conv-state")
    assert (h.action, h.patch, h.loses, h.first, h.fixed_in, h.ends) == (
        "patch", "cpu-gdn-wide-conv-state", "process", "0.22.0", "0.26.0", None
    )  # fmt: skip
    assert h.releases == ">=0.22.0,<0.26.0"
    assert "GDN" in h.models and "AMX" in h.models and "CPU build" in h.models
    assert "46090" in h.upstream
    got = hazards.assess(h, "0.24.0", {"cpu-gdn-wide-conv-state": "applied"})
    assert got["state"] == "patched" and got["loses"] == "process"
    got = hazards.assess(h, "0.24.0", {"cpu-gdn-wide-conv-state": "disabled"})
    assert got["state"] == "open"
    got = hazards.assess(h, "0.24.0", {"cpu-gdn-wide-conv-state": "not-needed"})
    assert got["state"] == "not-affected"
    got = hazards.assess(h, "0.24.0", {"abort-before-scheduling": "applied"})
    assert got["state"] == "open" and "missing" in got["reason"]
    assert got["loses"] == "process" and got["models"] == h.models
    assert hazards.assess(h, "0.21.0", {})["state"] == "not-affected"
    assert hazards.assess(h, "0.26.0", {})["state"] == "fixed-upstream"
    assert hazards.assess(h, "0.33.0", {})["state"] == "fixed-upstream"
    assert h not in hazards.refuse_config("0.24.0")  # no setting avoids it


# ---------------------------------------------------------------------------
# The shape gate on the releases' own files


@pytest.mark.parametrize("release", RELEASES)
def test_probe_on_each_release(release: str) -> None:
    got = probe_file(str(connector_file(release)), abort_unscheduled.probe_tree)
    want = KNOWN[release]
    if want == "fixed":
        assert got.fixed and got.shape is None, got
    elif want == "not-this-shape":
        assert not got.fixed and got.shape is None, got
    else:
        assert got.shape == want and not got.fixed, got


VARIANTS = {
    # the connector half of the fix alone: the crash moves to the scheduler's assert
    "pop with a default only": (
        "filename = self._request_filenames.pop(req_id)",
        "filename = self._request_filenames.pop(req_id, None)",
    ),
    # a metadata class that cannot carry the mark to the workers
    "metadata with slots": (
        "@dataclass\nclass ExampleHiddenStatesConnectorMetadata",
        "@dataclass(slots=True)\nclass ExampleHiddenStatesConnectorMetadata",
    ),
    # a request that never holds its blocks
    "request_finished returns False": (
        'return True, {"hidden_states_path": filename}',
        'return False, {"hidden_states_path": filename}',
    ),
    # the worker no longer reports requests without a copy (upstream's worker half)
    "get_finished reports copies only": (
        "if event is None or event.query():",
        "if event is not None and event.query():",
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_changed_connector_is_refused(variant: str) -> None:
    src = connector_file("0.24.0").read_text()
    old, new = VARIANTS[variant]
    assert src.count(old) == 1, variant
    tree = parse(src.replace(old, new))
    assert tree is not None
    got = abort_unscheduled.probe_tree(tree)
    assert got.shape is None and not got.fixed, (variant, got)


# ---------------------------------------------------------------------------
# The live class of the installed vLLM


def _live_class() -> Any:
    import importlib

    return importlib.import_module(CONNECTOR_MODULE).ExampleHiddenStatesConnector


needs_024 = pytest.mark.skipif(
    not (
        INSTALL.parsed
        and INSTALL.release
        and tuple(map(int, INSTALL.release.split("."))) >= (0, 24)
    ),
    reason="the check drives 0.24.0+'s connector (it holds scheduled requests)",
)
HOOKS = Hooks(on_failure=lambda pid, exc: None, after_register=lambda conn: None)


def _in_range() -> bool:
    return bool(INSTALL.release) and hazards.by_id("abort-before-scheduling").affects(
        INSTALL.release or ""
    )


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
@needs_024
def test_live_class_check_fails_without_the_patch_and_passes_with_it() -> None:
    """The release's own methods (any wrapper of ours switched off) fail the check; the
    connector half alone fails it too; the patch passes it and ``verify`` says so."""
    import importlib

    module = importlib.import_module(CONNECTOR_MODULE)
    cls = module.ExampleHiddenStatesConnector
    present = _switch_all(cls, False)  # put back on at the end: activation had them on
    try:
        before = abort_unscheduled.check_abort(cls)
        if not _in_range():
            assert before == [], before  # upstream's own fix (0.31.0+)
            return
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
        reps = [] if _switch_all(cls, True) else abort_unscheduled.apply(module, shape, HOOKS)
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
@needs_024
def test_the_mark_travels_with_the_metadata() -> None:
    """The multiprocessing executor pickles the scheduler output to the workers."""
    import importlib

    module = importlib.import_module(CONNECTOR_MODULE)
    meta = module.ExampleHiddenStatesConnectorMetadata()
    setattr(meta, abort_unscheduled.NOT_HELD, frozenset({"r1"}))
    back = pickle.loads(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL))
    assert getattr(back, abort_unscheduled.NOT_HELD) == frozenset({"r1"})
