"""``atomic-writes``: it reaches ``FP8HiddenStatesConnector``, which overrides only
``_write_tensors``; a subclass writer of an unknown shape is left alone and ``verify``
names it; its gate on one-line edits of 0.24.0's writer; the release's writer killed
mid-write leaves a truncated file, the patched one does not."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CONNECTOR_MODULE, NO_HOOKS, connector
from support.hsrows import NoEvent
from support.skeletons import probe_edited

from vllm_hsfix import checks
from vllm_hsfix.patches._wrap import ours_in
from vllm_hsfix.patches.atomic_writes import fix as atomic_writes
from vllm_hsfix.releases import key as release_key

pytestmark = [pytest.mark.needs_vllm]


# hs-connectors' fp8 writer: layered on the main rows' PYTHONPATH (scripts/run_tests.py).
needs_hs_connectors = pytest.mark.skipif(
    importlib.util.find_spec("hs_connectors") is None, reason="hs-connectors is not layered here"
)


@pytest.fixture
def applied(patched):  # type: ignore[no-untyped-def]
    sys.modules.pop("hs_connectors.fp8_hidden_states_connector", None)
    mod = importlib.import_module("hs_connectors.fp8_hidden_states_connector")
    yield mod
    sys.modules.pop("hs_connectors.fp8_hidden_states_connector", None)


@needs_hs_connectors
@pytest.mark.applies("atomic-writes")
def test_fp8_writer_writes_a_temporary_file_then_renames(applied, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file

    cls = applied.FP8HiddenStatesConnector
    seen: list[tuple[str, bool]] = []
    real = applied.save_file
    final = tmp_path / "req.safetensors"
    lock_fd = os.open(str(final) + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)

    def spy(tensors, filename):  # type: ignore[no-untyped-def]
        # Where the subclass's own body writes, and whether the lock is still held then.
        held = True
        try:
            os.fstat(lock_fd)
        except OSError:
            held = False
        seen.append((filename, held))
        return real(tensors, filename)

    monkeypatch.setattr(applied, "save_file", spy)
    tensors = {
        "hidden_states": torch.randn(5, 2, 8, dtype=torch.bfloat16),
        "token_ids": torch.arange(5),
    }
    cls._write_tensors(tensors, NoEvent(), str(final), lock_fd)
    ((written, held),) = seen
    assert written != str(final) and written.endswith(".hsfix-tmp"), written
    assert os.path.dirname(written) == str(tmp_path)
    assert held, "the lock was released before the file was in place"
    with pytest.raises(OSError):
        os.fstat(lock_fd)  # released afterwards, as the release's writer does
    data = load_file(str(final))
    assert data["hidden_states"].dtype == torch.float8_e4m3fn and "hidden_states_scales" in data
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".hsfix-tmp")] == []


@needs_hs_connectors
def test_without_the_patch_the_fp8_writer_writes_the_final_path(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Fails first: the same call, vllm-hsfix not applied, writes in place."""
    sys.modules.pop("hs_connectors.fp8_hidden_states_connector", None)
    mod = importlib.import_module("hs_connectors.fp8_hidden_states_connector")
    seen: list[str] = []
    real = mod.save_file
    monkeypatch.setattr(mod, "save_file", lambda t, f: (seen.append(f), real(t, f))[1])
    final = tmp_path / "req.safetensors"
    tensors = {"hidden_states": torch.randn(3, 2, 8), "token_ids": torch.arange(3)}
    mod.FP8HiddenStatesConnector._write_tensors(tensors, NoEvent(), str(final), None)
    assert seen == [str(final)]
    sys.modules.pop("hs_connectors.fp8_hidden_states_connector", None)


@needs_hs_connectors
@pytest.mark.applies("atomic-writes")
def test_verify_covers_the_fp8_writer_and_names_an_unknown_one(applied) -> None:  # type: ignore[no-untyped-def]
    from vllm_hsfix.patches.atomic_writes import fix as atomic_writes

    module = connector()
    base = module.ExampleHiddenStatesConnector

    class OwnWriter(base):  # a user's subclass that writes with open(): not wrapped
        @staticmethod
        def _write_tensors(tensors, event, filename, lock_fd):  # type: ignore[no-untyped-def]
            with open(filename, "wb") as fh:
                fh.write(b"x")

    results = atomic_writes.verify(module, checks.Context("cpu", None))
    by_name = {r["check"].split(" ")[0]: r for r in results}
    fp8 = by_name[
        "hs_connectors.fp8_hidden_states_connector.FP8HiddenStatesConnector._write_tensors"
    ]
    assert fp8["ok"], fp8
    own = [r for name, r in by_name.items() if "OwnWriter" in name]
    assert own and not own[0]["ok"]
    assert own[0]["problems"][0].startswith("not covered: ")
    assert "save_file" in own[0]["problems"][0]
    assert type(OwnWriter.__dict__["_write_tensors"]) is staticmethod  # left alone


# ---------------------------------------------------------------------------
# The shape gate on changed files


# One-line edits of 0.24.0's connector: (old, new, whether the gate must call the result
# fixed upstream); never a shape it patches.
VARIANTS = {
    "writer renames into place": (
        "save_file(tensors, filename)",
        "save_file(tensors, filename + '.tmp')\n"
        "            os.replace(filename + '.tmp', filename)",
        True,
    ),
    "writer unlocks before the write": (
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
    old, new, fixed = VARIANTS[variant]
    got = probe_edited(atomic_writes, old, new)
    assert got.shape is None and got.fixed is fixed, (variant, got)  # type: ignore[attr-defined]


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
