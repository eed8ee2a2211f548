"""The hazard register against the patch table, and ``assess`` on releases chosen by
hand. A patched hazard's own proof is its row's file in tests/patches/; engine level:
tests/e2e/test_hazards_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_hsfix import hazards
from vllm_hsfix.patches import PATCH_IDS, by_id

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


EVIDENCE = (Path(__file__).resolve().parents[2] / "docs" / "hazards.md").read_text()


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
        "chunked-prefill-refused": ">=0.22.0,<0.24.0",  # PR 43805
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
