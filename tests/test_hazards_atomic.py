"""The ``atomic-writes`` patch, without an engine: the release's writer killed mid-write
(``support/children/killed_writer.py``), the shape gate on the real connector files of
every release on this machine and on variants of 0.24.0's, and ``verify``'s check of
the live writer. The abort-before-scheduling patch and the register: test_hazards.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import CONNECTOR_MODULE, NO_HOOKS, connector
from support.skeletons import RELEASES, connector_file

from vllm_hsfix.patches import atomic_writes
from vllm_hsfix.patches._wrap import ours_in
from vllm_hsfix.releases import key as release_key
from vllm_hsfix.shapes import parse, probe_file

KILL_CHILD = Path(__file__).resolve().parent / "support" / "children" / "killed_writer.py"


# ---------------------------------------------------------------------------
# atomic-writes: the release's writer killed mid-write


@pytest.mark.needs_vllm
@pytest.mark.applies("atomic-writes")
def test_a_writer_killed_mid_write_leaves_no_truncated_file(tmp_path: Path) -> None:
    """The release's ``_write_tensors`` (0.22.0+), killed by the kernel mid-write (a 1 MB
    file-size limit, 8 MB to write, an older complete file at the path). Failing first:
    with safetensors < 0.8.0's in-place write (a stand-in writing exactly as it does) the
    path then holds a truncated file a waiting reader cannot load. Patched: the older
    file is intact, only a temporary file is left. With the installed safetensors the
    release's own result is reported as measured (0.8.0 renames into place itself)."""
    from conftest import clean_env, last_json, run_py

    argv = [str(KILL_CHILD), str(tmp_path), CONNECTOR_MODULE]
    code = (
        f"import runpy, sys\nsys.argv = {argv!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    proc = run_py(code, env=clean_env(VLLM_HSFIX_DISABLE="1"), timeout=300)
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
    if release_key(out["safetensors"]) >= release_key("0.8.0"):
        assert out["release-installed"]["content"] == "old", out
    else:
        assert out["release-installed"]["content"].startswith("unloadable"), out


@pytest.mark.parametrize("release", RELEASES)
def test_atomic_writes_probe_on_each_release(release: str) -> None:
    got = probe_file(str(connector_file(release)), atomic_writes.probe_tree)
    if release_key(release) < release_key("0.22.0"):  # no writer thread
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
