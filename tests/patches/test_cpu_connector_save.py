"""``cpu-connector-save`` and ``cpu-sampler-fp64-flag`` on the real installed vLLM; what
the file must hold comes from block ids and slot arithmetic."""

from __future__ import annotations

import ast
import contextlib
import inspect
import os
import threading
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import INSTALL, connector
from support.lockfile import held

from vllm_hsfix import checks, releases
from vllm_hsfix.patches.cpu_connector_save import fix as save
from vllm_hsfix.patches.cpu_sampler_fp64_flag import fix as sampler

pytestmark = pytest.mark.needs_vllm
SAMPLER_MODULE = "vllm.utils.cpu_triton_utils"
needs_save = pytest.mark.applies(save.PATCH_ID)
needs_sampler = pytest.mark.applies(sampler.PATCH_ID)
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the check is for a CPU machine")


def save_method() -> str:
    """The release's save method the patch replaces (which one each release has is
    stated by hand in test_shapes.py's ``STATED_SHAPES``)."""
    shape = save.probe(connector()).shape
    assert shape is not None, "cpu-connector-save does not recognise this release's connector"
    return save.SHAPES[shape][0]


def _mutated(edit: Any) -> ast.Module:
    tree = ast.parse(inspect.getsource(connector()))
    edit(tree)
    return tree


def _method(tree: ast.Module, name: str) -> ast.FunctionDef:
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == save.ATTRIBUTE)
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


@needs_save
def test_the_save_gate_refuses_a_changed_save_method_and_a_new_event_use() -> None:
    target = save_method()

    def extra_statement(tree: ast.Module) -> None:
        _method(tree, target).body.insert(0, ast.parse("self._hsfix_probe_marker = 1").body[0])

    p = save.probe_tree(_mutated(extra_statement))
    assert p.shape is None and not p.fixed and f"{target} is a known body" in p.detail

    def timed_events(tree: ast.Module) -> None:
        _method(tree, "get_finished").body.insert(0, ast.parse("event.elapsed_time(event)").body[0])

    p = save.probe_tree(_mutated(timed_events))
    assert p.shape is None and "events used only through" in p.detail


@needs_save
def test_a_connector_without_cuda_is_upstream_fixed() -> None:
    """A connector that no longer touches ``torch.cuda`` saves on a CPU itself: left alone."""

    class NoCuda(ast.NodeTransformer):
        def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
            self.generic_visit(node)
            if (
                isinstance(node.value, ast.Name)
                and node.value.id == "torch"
                and node.attr == "cuda"
            ):
                return ast.Attribute(value=node.value, attr="accelerator", ctx=node.ctx)
            return node

    p = save.probe_tree(_mutated(lambda t: NoCuda().visit(t)))
    assert p.fixed, p


@needs_save
@no_cuda
def test_the_release_save_path_fails_on_a_cpu() -> None:
    """Failing first: the release's own connector cannot save from a CPU buffer here."""
    import vllm_hsfix

    vllm_hsfix.unapply()  # the release's own methods (the suite may have activated it)
    problems = save.check_save(connector())
    assert problems and "the save path raised" in problems[0], problems


@needs_save
@no_cuda
def test_the_patched_save_path_writes_the_requests_rows(patched: Any) -> None:
    assert patched.status()["patches"][save.PATCH_ID]["status"] == "applied"
    assert save.check_save(connector()) == []


@contextlib.contextmanager
def _writer_held(conn: Any) -> Any:
    """Keep the connector's one writer thread busy until the block exits."""
    gate = threading.Event()
    conn._executor.submit(gate.wait, 30)
    try:
        yield
    finally:
        gate.set()


@needs_save
@no_cuda
def test_same_file_and_same_lock_protocol(patched: Any, tmp_path: Path) -> None:
    """The ``.lock`` is held from before the path reaches a client until the file is whole;
    the file is byte for byte what ``save_file`` writes."""
    from safetensors.torch import save as serialize

    module = connector()
    case = save.save_case()
    path = str(tmp_path / "req-0.safetensors")
    conn = save.new_connector(module)
    try:
        with _writer_held(conn):
            finished, _ = save.save_request(module, conn, case, path, "req-0")
            assert finished == {"req-0"}  # the copy is complete: the request is done
            assert not os.path.exists(path) and held(path)
        assert save.wait_unlocked(path)
        want = serialize({"hidden_states": case["expected"], "token_ids": case["token_ids"]})
        assert Path(path).read_bytes() == want
    finally:
        conn._executor.shutdown(wait=True)


@needs_save
@no_cuda
def test_a_buffer_off_the_host_goes_to_the_release_path(patched: Any, tmp_path: Path) -> None:
    """Only a host buffer takes the synchronous copy; any other device (here ``meta``)
    reaches the release's own method, whose CUDA copy fails on this machine."""
    module = connector()
    case = save.save_case()
    case["buffer"] = case["buffer"].to("meta")
    target = save_method()
    conn = save.new_connector(module)
    try:
        with pytest.raises(Exception) as info:
            save.save_request(module, conn, case, str(tmp_path / "m.safetensors"), "m")
        frames = [
            (Path(f.filename).name, f.name) for f in traceback.extract_tb(info.value.__traceback__)
        ]
        # The release's method ran (its own file, its own name) and raised below it.
        assert (Path(module.__file__).name, target) in frames, frames
    finally:
        for fd in conn._lock_fds.values() if hasattr(conn, "_lock_fds") else ():
            os.close(fd)
        conn._executor.shutdown(wait=True)


@needs_save
@no_cuda
@pytest.mark.skipif(
    releases.key(INSTALL.release or "0") < (0, 24, 0),
    reason="the connector saves from its block size from 0.24.0 (0.22-0.23: the step's slots)",
)
def test_it_saves_with_the_hidden_groups_own_block_size(patched: Any, tmp_path: Path) -> None:
    """With a hybrid layout (global block size 528, hidden-states group 22) the save reads
    with 22, the block size of the buffer it was given."""
    module = connector()
    config, want = checks.hybrid_layout()
    conn = checks.construct_connector(module.ExampleHiddenStatesConnector, config, 528)
    assert conn._block_size == want["block_size"] == 22
    from concurrent.futures import ThreadPoolExecutor

    conn._executor = ThreadPoolExecutor(max_workers=1)
    b = torch.arange(3).view(-1, 1, 1, 1)
    i = torch.arange(22).view(1, -1, 1, 1)
    j = torch.arange(22).view(1, 1, -1, 1)
    buffer = (1000 * b + 100 * (i + j) + torch.arange(2).view(1, 1, 1, -1)).float()
    ids = torch.arange(30)
    expected = torch.stack(
        [buffer[[2, 0][t // 22], t % 22] for t in range(30)]  # blocks 2 then 0, offsets
    )
    path = str(tmp_path / "h.safetensors")
    try:
        save.save_request(
            module,
            conn,
            {"buffer": buffer, "block_ids": [2, 0], "token_ids": ids},
            path,
            "h",
        )
        assert save.wait_unlocked(path)
        got = module.load_hidden_states(path)
        assert got["hidden_states"].equal(expected) and got["token_ids"].equal(ids)
    finally:
        conn._executor.shutdown(wait=True)
