"""The hazard register, the ``abort-before-scheduling`` and ``atomic-writes`` patches,
without an engine: the register against the patch table, ``assess`` on releases chosen
by hand, the gates on one-line edits of 0.24.0's connector, and the live connector class
and writer failing without the patch and passing with it. Engine level:
test_hazards_e2e.py."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
from conftest import CONNECTOR_MODULE, INSTALL, NO_HOOKS, connector
from support.skeletons import connector_file

from vllm_hsfix import checks, hazards
from vllm_hsfix.patches import PATCH_IDS, by_id
from vllm_hsfix.patches._wrap import ours_in, wrap
from vllm_hsfix.patches.abort_before_scheduling import fix as abort_unscheduled
from vllm_hsfix.patches.atomic_writes import fix as atomic_writes
from vllm_hsfix.releases import key as release_key
from vllm_hsfix.shapes import parse

# ---------------------------------------------------------------------------
# The register


def test_register_rows_are_complete() -> None:
    assert len(set(hazards.HAZARD_IDS)) == len(hazards.HAZARDS)
    for h in hazards.HAZARDS:
        assert h.action in {"patch", "documented"}, h.id  # docs/hazards.md
        assert h.loses in (hazards.PROCESS, hazards.DATA), h.id
        assert h.upstream, h.id
        assert f"### `{h.id}`" in EVIDENCE, f"{h.id}: no evidence in docs/hazards.md"
        if h.action == hazards.PATCH:
            assert h.patch in PATCH_IDS, h.id
        if h.action == hazards.DOCUMENTED:
            assert h.workaround and h.why_action, f"{h.id}: say what to do, and why only that"


EVIDENCE = (Path(__file__).resolve().parent.parent / "docs" / "hazards.md").read_text()


def test_every_hazard_that_writes_wrong_data_has_a_patch() -> None:
    """No "a WARNING, then wrong files": each hazard that loses data is patched, none only
    documented (the data hazards listed by hand from docs/hazards.md)."""
    data = {h.id: h.action for h in hazards.HAZARDS if h.loses == hazards.DATA}
    assert data == dict.fromkeys(
        ["aux-final-layer-dropped", "prefix-cache-slicing", "torn-files-in-step",
         "every-rank-writes", "drafter-skip", "torn-files", "next-token-first-column"],
        hazards.PATCH,
    )  # fmt: skip


def test_a_patched_hazard_spans_the_releases_its_bug_is_in() -> None:
    """Each patched hazard's releases, stated by hand from upstream's PRs (a bug with no
    known upstream fix stays open-ended: a release not read yet is not called fixed)."""
    stated = {
        "abort-before-scheduling": ">=0.24.0,<0.31.0",
        "aux-final-layer-dropped": ">=0.18.0,<0.25.0",
        "torn-files": ">=0.22.0",
        "cpu-amx-gdn-conv-state": ">=0.22.0,<0.26.0",
        "prefix-cache-slicing": ">=0.22.0,<0.24.0",
        "every-rank-writes": ">=0.17.0,<0.24.0",
        "drafter-skip": ">=0.25.0,<0.29.0",
        "torn-files-in-step": ">=0.17.0,<0.22.0",
        "next-token-first-column": ">=0.17.0",  # PR 56442 not merged
        # issue 57: read in the 0.17.0-0.20.0 wheels
        "nested-text-config": ">=0.17.0,<0.20.0",
        "hidden-cache-dtype": ">=0.17.0,<0.20.0",
        "draft-column": ">=0.17.0,<0.20.0",
        "no-new-blocks": ">=0.17.0,<0.18.0",
    }
    got = {h.id: h.releases for h in hazards.HAZARDS if h.action == hazards.PATCH}
    assert got == stated
    assert all(by_id(h.patch).first == h.first for h in hazards.HAZARDS if h.patch)


@pytest.mark.parametrize(
    ("hazard", "release", "affected"),
    [
        # A patched hazard's range is its patch row's (the test above), and the rows'
        # ranges are stated by hand in scripts/fingerprints.py (test_shapes.py); here the
        # hazards without a patch, and a local version label.
        ("abort-before-scheduling", "0.24.1.dev3+gabc", True),
        # a patch release inside a row's range
        ("drafter-skip", "0.25.1", True),
        ("drafter-skip", "0.28.9", True),
        ("prefix-cache-slicing", "0.22.1", True),
        ("torn-files", "0.21.0", False),
        ("torn-files", "0.22.0", True),
        ("torn-files", "0.33.0", True),
        ("torn-files-in-step", "0.16.0", False),
        ("torn-files-in-step", "0.17.0", True),
        ("torn-files-in-step", "0.21.0", True),
        ("torn-files-in-step", "0.22.0", False),
        ("cpu-amx-gdn-stale-tiles", "0.21.0", False),  # scripts/amx_gdn_probe.py: 0.22-0.26
        ("cpu-amx-gdn-stale-tiles", "0.26.0", True),
        ("cpu-amx-gdn-stale-tiles", "0.27.0", False),
    ],
)
def test_affected_releases(hazard: str, release: str, affected: bool) -> None:
    assert hazards.by_id(hazard).affects(release) is affected


ABORT, AMX = "abort-before-scheduling", "cpu-gdn-wide-conv-state"


@pytest.mark.parametrize(
    ("hazard", "release", "codes", "state"),
    [
        (ABORT, "0.23.0", {}, "not-affected"),
        (ABORT, "0.24.0", {ABORT: "would-apply"}, "patched"),
        (ABORT, "0.24.0", {ABORT: "applied"}, "patched"),
        (ABORT, "0.24.0", {ABORT: "unknown-shape"}, "open"),
        (ABORT, "0.24.0", {ABORT: "disabled"}, "open"),
        (ABORT, "0.31.0", {ABORT: "upstream-fix-present"}, "fixed-upstream"),
        (ABORT, None, {}, "unknown"),
        ("cpu-amx-gdn-conv-state", "0.24.0", {AMX: "not-needed"}, "not-affected"),
        ("cpu-amx-gdn-conv-state", "0.21.0", {}, "not-affected"),
        ("cpu-amx-gdn-conv-state", "0.26.0", {}, "fixed-upstream"),
        ("torn-files-in-step", "0.22.0", {}, "fixed-upstream"),  # the writer moved (0.22)
        ("torn-files-in-step", "not a version", {}, "unknown"),
    ],
)
def test_assess(hazard: str, release: str | None, codes: dict[str, str], state: str) -> None:
    h = hazards.by_id(hazard)
    got = hazards.assess(h, release, codes)
    assert (got["state"], got["action"], got["loses"]) == (state, h.action, h.loses), got


@pytest.mark.parametrize(
    ("amx", "state"), [(False, "not-affected"), (True, "exposed"), (None, "exposed")]
)
def test_an_amx_hazard_is_exposed_only_where_the_cpu_has_amx(amx: bool | None, state: str) -> None:
    stale = hazards.by_id("cpu-amx-gdn-stale-tiles")
    got = hazards.assess(stale, "0.24.0", {}, cpu_build=True, amx=amx)
    assert got["state"] == state
    assert (got["reason"] == "this CPU has no AMX") == (amx is False)


@pytest.mark.parametrize(
    ("flags", "amx"),
    [("fpu sse avx512f amx_bf16 amx_tile amx_int8", True), ("fpu sse avx512f", False)],
)
def test_cpu_has_amx_reads_the_kernels_flags(tmp_path: Path, flags: str, amx: bool) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    assert hazards.cpu_has_amx(str(info)) is amx
    assert hazards.cpu_has_amx(str(tmp_path / "absent")) is None


def test_assess_says_why() -> None:
    tiles = hazards.by_id("cpu-amx-gdn-stale-tiles")
    assert hazards.assess(tiles, "0.24.0", {}) | {"reason": ""} == {
        "action": "documented",
        "releases": ">=0.22.0,<0.27.0",
        "loses": "process",
        "upstream": tiles.upstream,
        "models": tiles.models,
        "state": "exposed",
        "reason": "",
    }
    assert hazards.assess(tiles, "0.24.0", {})["reason"] == tiles.workaround
    amx = hazards.by_id("cpu-amx-gdn-conv-state")
    got = hazards.assess(amx, "0.24.0", {ABORT: "applied"})  # its own patch not reported
    assert got["state"] == "open" and "missing" in got["reason"]
    assert got["models"] == amx.models and "GDN" in amx.models and "AMX" in amx.models
    every = hazards.assess_all("0.25.0", {ABORT: "would-apply"})
    assert set(every) == set(hazards.HAZARD_IDS)
    # The SIGILL lives in vLLM's CPU kernels: named on the CPU build, not on CUDA wheels.
    tiles = hazards.by_id("cpu-amx-gdn-stale-tiles")
    on = {cpu: hazards.assess(tiles, "0.24.0", {}, cpu_build=cpu)["state"] for cpu in (True, False)}
    assert on == {True: "exposed", False: "not-affected"}


# ---------------------------------------------------------------------------
# The shape gate on changed files


# One-line edits of 0.24.0's connector: (the patch whose gate reads it, old, new, whether
# the gate must call the result fixed upstream); never a shape it patches.
VARIANTS = {
    # the connector half of the fix alone: the crash moves to the scheduler's assert
    "pop with a default only": (
        abort_unscheduled,
        "filename = self._request_filenames.pop(req_id)",
        "filename = self._request_filenames.pop(req_id, None)",
        False,
    ),
    # a metadata class that cannot carry the mark to the workers
    "metadata with slots": (
        abort_unscheduled,
        "@dataclass\nclass ExampleHiddenStatesConnectorMetadata",
        "@dataclass(slots=True)\nclass ExampleHiddenStatesConnectorMetadata",
        False,
    ),
    # a request that never holds its blocks
    "request_finished returns False": (
        abort_unscheduled,
        'return True, {"hidden_states_path": filename}',
        'return False, {"hidden_states_path": filename}',
        False,
    ),
    # the worker no longer reports requests without a copy (upstream's worker half)
    "get_finished reports copies only": (
        abort_unscheduled,
        "if event is None or event.query():",
        "if event is not None and event.query():",
        False,
    ),
    "writer renames into place": (
        atomic_writes,
        "save_file(tensors, filename)",
        "save_file(tensors, filename + '.tmp')\n"
        "            os.replace(filename + '.tmp', filename)",
        True,
    ),
    "writer unlocks before the write": (
        atomic_writes,
        "            event.synchronize()\n            save_file(tensors, filename)\n"
        "        finally:\n            if lock_fd is not None:\n"
        "                os.close(lock_fd)  # releases LOCK_EX",
        "            if lock_fd is not None:\n                os.close(lock_fd)\n"
        "        finally:\n            event.synchronize()\n"
        "            save_file(tensors, filename)",
        False,
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_changed_connector_is_not_patched(variant: str) -> None:
    impl, old, new, fixed = VARIANTS[variant]
    src = connector_file("0.24.0").read_text()
    assert src.count(old) == 1, variant
    tree = parse(src.replace(old, new))
    assert tree is not None
    got = impl.probe_tree(tree)
    assert got.shape is None and got.fixed is fixed, (variant, got)


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


# ---------------------------------------------------------------------------
# atomic-writes: the release's writer killed mid-write


@pytest.mark.needs_vllm
@pytest.mark.applies("atomic-writes-in-step")
def test_a_step_killed_mid_write_leaves_no_truncated_file(tmp_path: Path) -> None:
    """0.17-0.21: the release's in-step ``save_kv_layer`` killed by the kernel mid-write
    (1 MB limit, 8 MB of hidden states, an older file at the path), with safetensors <
    0.8.0's in-place write. Failing first: the release leaves a truncated file at the
    path. Patched: the older file is intact, only a temporary file is left."""
    import signal

    from conftest import clean_env, last_json
    from support.procs import child

    env = clean_env(VLLM_HSFIX_DISABLE="1")
    proc = child("killed_step_writer.py", tmp_path, CONNECTOR_MODULE, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    print(out)
    assert [out[c]["killed_by"] for c in ("release", "patched")] == [signal.SIGXFSZ] * 2, out
    torn = out["release"]
    assert torn["size"] == 1 << 20 and torn["content"].startswith("unloadable"), torn
    assert out["patched"]["content"] == "old", out["patched"]
    assert any(n.endswith(".hsfix-tmp") for n in out["patched"]["leftovers"]), out


@pytest.mark.needs_vllm
@pytest.mark.applies("atomic-writes")
def test_a_writer_killed_mid_write_leaves_no_truncated_file(tmp_path: Path) -> None:
    """The release's ``_write_tensors`` (0.22.0+), killed by the kernel mid-write (a 1 MB
    file-size limit, 8 MB to write, an older complete file at the path). Failing first:
    with safetensors < 0.8.0's in-place write (a stand-in writing exactly as it does) the
    path then holds a truncated file a waiting reader cannot load. Patched: the older
    file is intact, only a temporary file is left. With the installed safetensors the
    release's own result is reported as measured (0.8.0 renames into place itself)."""
    from conftest import clean_env, last_json
    from support.procs import child

    env = clean_env(VLLM_HSFIX_DISABLE="1")
    proc = child("killed_writer.py", tmp_path, CONNECTOR_MODULE, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    print(out)
    import signal

    for case in ("release-in-place", "patched-in-place", "release-installed", "patched-installed"):
        assert out[case]["killed_by"] == signal.SIGXFSZ, (case, out[case])
    torn = out["release-in-place"]
    assert torn["size"] == 1 << 20 and torn["content"].startswith("unloadable"), torn
    for case in ("patched-in-place", "patched-installed"):
        assert out[case]["content"] == "old", (case, out[case])
    assert any(n.endswith(".hsfix-tmp") for n in out["patched-in-place"]["leftovers"]), out
    if release_key(out["safetensors"]) >= release_key("0.8.0"):
        assert out["release-installed"]["content"] == "old", out
    else:
        assert out["release-installed"]["content"].startswith("unloadable"), out


@pytest.mark.needs_vllm
@pytest.mark.applies("atomic-writes")
def test_writer_check_fails_in_place_and_passes_patched() -> None:
    """``verify``'s check on the live writer: with an in-place ``save_file`` (what
    safetensors < 0.8.0 does) the release's writer fails it, the patched one passes."""
    from safetensors.torch import save

    module = connector()
    cls = module.ExampleHiddenStatesConnector

    def in_place(tensors: Any, filename: str, metadata: Any = None) -> None:
        with open(filename, "wb") as fh:
            fh.write(save(tensors, metadata=metadata))

    ours = ours_in(cls.__dict__.get("_write_tensors"), atomic_writes.PATCH_ID)
    real = module.save_file
    module.save_file = in_place
    try:
        if ours is not None:
            ours.hsfix_set_active(False)
        problems = atomic_writes.check_writer(cls)
        assert any("written in place" in p for p in problems), problems
        if ours is not None:
            ours.hsfix_set_active(True)
            assert atomic_writes.check_writer(cls) == []
        else:
            reps = atomic_writes.apply(module, atomic_writes.SHAPE, NO_HOOKS)
            try:
                assert atomic_writes.check_writer(cls) == []
            finally:
                for rep in reps:
                    rep.restore()
    finally:
        module.save_file = real
        if ours is not None:
            ours.hsfix_set_active(True)
