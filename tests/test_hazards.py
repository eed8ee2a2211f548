"""The hazard register and the ``abort-before-scheduling`` patch, without an engine.

* the register is well formed and agrees with the patch table;
* ``assess`` on releases chosen by hand (expected states written here, not computed);
* the shape gate on the real connector files of every release on this machine, and on
  one-line variants of 0.24.0's (each must be refused: the crash would stay or move);
* on the installed vLLM (0.24.0+): the live connector class driven through an abort
  before scheduling fails without the patch (KeyError) and with only its connector
  half (the declined request is still reported), and passes patched; the metadata's
  mark survives pickling, as on the way to a worker process.

The engine-level evidence is in test_hazards_e2e.py.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
from conftest import CACHE, CONNECTOR_MODULE, INSTALL

from vllm_hsfix import checks, hazards
from vllm_hsfix.patches import PATCH_IDS, abort_unscheduled, atomic_writes, by_id
from vllm_hsfix.patches._wrap import ours_in, wrap
from vllm_hsfix.patches.hooks import Hooks
from vllm_hsfix.shapes import parse, probe_file

SKELETONS = CACHE / "cuda-skeletons"
CONN = Path("vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py")
RELEASES = [
    "0.17.0",
    "0.18.0",
    "0.19.0",
    "0.20.0",
    "0.21.0",
    "0.22.0",
    "0.23.0",
    "0.24.0",
    "0.25.0",
    "0.26.0",
    "0.27.0",
    "0.28.0",
    "0.29.0",
    "0.30.0",
    "0.31.0",
    "0.32.0",
    "0.33.0",
]
# What each release's connector is, for this patch: read off the files by hand
# (request_finished's pop and get_finished's report), independent of the probe.
KNOWN = {
    **dict.fromkeys(RELEASES[:7], "not-this-shape"),  # 0.17-0.23
    **dict.fromkeys(RELEASES[7:14], abort_unscheduled.SHAPE),  # 0.24-0.30
    **dict.fromkeys(RELEASES[14:], "fixed"),  # 0.31-0.33
}


def connector_file(release: str) -> Path:
    path = SKELETONS / f"vllm-{release}" / CONN
    if not path.exists():
        pytest.skip(f"no CUDA skeleton of vLLM {release} here ({path})")
    return path


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
                assert hazards.Version(p.fixed_in) > hazards.Version(LAST_READ), h.id
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
    h = hazards.by_id("aux-final-layer-dropped")
    assert hazards.assess(h, "0.24.0", {})["state"] == "exposed"
    assert hazards.assess(h, "0.24.0", {})["reason"] == h.workaround
    assert hazards.assess(h, "0.32.0", {})["state"] == "fixed-upstream"
    torn = hazards.by_id("torn-files-in-step")
    assert hazards.assess(torn, "0.20.0", {})["state"] == "exposed"
    assert hazards.assess(torn, "0.22.0", {})["state"] == "not-affected"  # ended, not fixed
    assert hazards.assess(h, "not a version", {})["state"] == "unknown"
    every = hazards.assess_all("0.25.0", {"abort-before-scheduling": "would-apply"})
    assert set(every) == set(hazards.HAZARD_IDS)


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


# ---------------------------------------------------------------------------
# atomic-writes: the release's writer killed mid-write

KILL_CHILD = r"""
import fcntl, importlib, json, os, resource, signal, sys
import torch
from safetensors.torch import load_file, save, save_file

from vllm_hsfix.patches import atomic_writes
from vllm_hsfix.patches.hooks import Hooks

LIMIT = 1 << 20  # the writer is killed (SIGXFSZ) when a file grows past 1 MB
work = sys.argv[1]
module = importlib.import_module(sys.argv[2])
cls = module.ExampleHiddenStatesConnector
old = {"hidden_states": torch.ones(4, 2, 3), "token_ids": torch.arange(4)}
new = {"hidden_states": torch.zeros(2048, 4, 256), "token_ids": torch.arange(2048)}  # 8 MB


class Done:
    def synchronize(self):
        return None


def in_place(tensors, filename, metadata=None):
    # What safetensors < 0.8.0 does: open the final path with O_TRUNC, write.
    with open(filename, "wb") as fh:
        fh.write(save(tensors, metadata=metadata))


def one(case, patched, writer):
    final = os.path.join(work, case + ".safetensors")
    save_file(old, final)
    if writer is not None:
        module.save_file = writer
    reps = atomic_writes.apply(module, atomic_writes.SHAPE, Hooks(print, print)) if patched else []
    pid = os.fork()
    if pid == 0:  # the writer: killed by the kernel at the limit, as by the OOM killer
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))
        fd = os.open(final + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        cls._write_tensors(new, Done(), final, fd)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    for r in reps:
        r.restore()
    with open(final + ".lock") as lf:  # a reader: the dead writer's lock is released
        fcntl.flock(lf, fcntl.LOCK_SH)
        try:
            got = load_file(final)
            content = "old" if torch.equal(got["token_ids"], old["token_ids"]) else "other"
        except Exception as exc:
            content = "unloadable: " + type(exc).__name__
    return {
        "killed_by": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "size": os.path.getsize(final),
        "content": content,
        "leftovers": sorted(n for n in os.listdir(work) if n.startswith(".")),
    }


real = module.save_file
out = {
    "release-in-place": one("a", False, in_place),
    "patched-in-place": one("b", True, in_place),
    "release-installed": one("c", False, real),
    "patched-installed": one("d", True, real),
}
import safetensors
out["safetensors"] = safetensors.__version__
print(json.dumps(out))
"""


@pytest.mark.needs_vllm
def test_a_writer_killed_mid_write_leaves_no_truncated_file(tmp_path: Path) -> None:
    """The release's ``_write_tensors`` (0.22.0+), killed by the kernel mid-write (a 1 MB
    file-size limit, 8 MB to write, an older complete file at the path). Failing first:
    with safetensors < 0.8.0's in-place write (a stand-in writing exactly as it does) the
    path then holds a truncated file a waiting reader cannot load. Patched: the older
    file is intact, only a temporary file is left. With the installed safetensors the
    release's own result is reported as measured (0.8.0 renames into place itself)."""
    first = hazards.Version(by_id("atomic-writes").first)
    if not (INSTALL.release and hazards.Version(INSTALL.release) >= first):
        pytest.skip("no writer thread before 0.22.0")
    from conftest import clean_env, last_json, run_py

    argv = ["x", str(tmp_path), CONNECTOR_MODULE]
    code = f"import sys\nsys.argv = {argv!r}\n"
    proc = run_py(code + KILL_CHILD, env=clean_env(VLLM_HSFIX_DISABLE="1"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    print(out)
    import signal

    for case in ("release-in-place", "patched-in-place", "release-installed", "patched-installed"):
        assert out[case]["killed_by"] == signal.SIGXFSZ, (case, out[case])
    torn = out["release-in-place"]
    assert torn["size"] == 1 << 20 and torn["content"].startswith("unloadable"), torn
    # The audit names the hazard behind the file the release's writer left (issue 19).
    from vllm_hsfix.audit import pipeline

    rep = pipeline.check_file(tmp_path / "a.safetensors")
    assert rep.verdict == "corrupt"
    assert {p.code: p.hazard for p in rep.problems}.get("truncated") == "torn-files", rep
    for case in ("patched-in-place", "patched-installed"):
        assert out[case]["content"] == "old", (case, out[case])
    assert any(n.endswith(".hsfix-tmp") for n in out["patched-in-place"]["leftovers"]), out
    if hazards.Version(out["safetensors"]) >= hazards.Version("0.8.0"):
        assert out["release-installed"]["content"] == "old", out
    else:
        assert out["release-installed"]["content"].startswith("unloadable"), out


@pytest.mark.parametrize("release", RELEASES)
def test_atomic_writes_probe_on_each_release(release: str) -> None:
    got = probe_file(str(connector_file(release)), atomic_writes.probe_tree)
    if hazards.Version(release) < hazards.Version("0.22.0"):  # no writer thread
        assert got.shape is None and not got.fixed, got
    else:  # 0.22.0-0.33.0: save_file on the final path, then unlock
        assert got.shape == atomic_writes.SHAPE, got


WRITER_VARIANTS = {
    "renames into place": (
        "save_file(tensors, filename)",
        "save_file(tensors, filename + '.tmp')\n"
        "            os.replace(filename + '.tmp', filename)",
        "fixed",
    ),
    "unlocks before the write": (
        "            event.synchronize()\n            save_file(tensors, filename)\n"
        "        finally:\n            if lock_fd is not None:\n"
        "                os.close(lock_fd)  # releases LOCK_EX",
        "            if lock_fd is not None:\n                os.close(lock_fd)\n"
        "        finally:\n            event.synchronize()\n"
        "            save_file(tensors, filename)",
        "unknown",
    ),
}


@pytest.mark.parametrize("variant", sorted(WRITER_VARIANTS))
def test_a_changed_writer_is_not_patched(variant: str) -> None:
    src = connector_file("0.24.0").read_text()
    old, new, want = WRITER_VARIANTS[variant]
    assert src.count(old) == 1, variant
    tree = parse(src.replace(old, new))
    assert tree is not None
    got = atomic_writes.probe_tree(tree)
    assert got.shape is None and got.fixed is (want == "fixed"), (variant, got)


@pytest.mark.needs_vllm
def test_writer_check_fails_in_place_and_passes_patched() -> None:
    """``verify``'s check on the live writer: with an in-place ``save_file`` (what
    safetensors < 0.8.0 does) the release's writer fails it, the patched one passes."""
    first = hazards.Version(by_id("atomic-writes").first)
    if not (INSTALL.release and hazards.Version(INSTALL.release) >= first):
        pytest.skip("no writer thread before 0.22.0")
    import importlib

    from safetensors.torch import save

    module = importlib.import_module(CONNECTOR_MODULE)
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
            reps = atomic_writes.apply(module, atomic_writes.SHAPE, HOOKS)
            try:
                assert atomic_writes.check_writer(cls) == []
            finally:
                for rep in reps:
                    rep.restore()
    finally:
        module.save_file = real
        if ours is not None:
            ours.hsfix_set_active(True)
