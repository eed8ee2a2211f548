"""``atomic-writes`` reaches ``FP8HiddenStatesConnector``, which overrides only
``_write_tensors``; a subclass writer of an unknown shape is left alone and ``verify``
names it."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch
from conftest import connector
from support.hsrows import NoEvent

from vllm_hsfix import checks

pytestmark = [pytest.mark.needs_vllm]

hs_connectors = pytest.importorskip(
    "hs_connectors", reason="hs-connectors is layered on the 0.24.0/0.25.0 rows"
)


@pytest.fixture
def applied(patched):  # type: ignore[no-untyped-def]
    sys.modules.pop("hs_connectors.fp8_hidden_states_connector", None)
    mod = importlib.import_module("hs_connectors.fp8_hidden_states_connector")
    yield mod
    sys.modules.pop("hs_connectors.fp8_hidden_states_connector", None)


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
