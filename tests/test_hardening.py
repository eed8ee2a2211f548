"""Issue 11: the patcher fails closed, reverts for good, reports the truth, and survives
fork, reload, late activation, other people's wrappers and logging; its post-import
hooks fire once, after the module body. Each test asserts on what the live objects do,
in a fresh interpreter but for the revert test of every patch."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import RELEASE, clean_env, declared_all, last_json, run_py

from vllm_hsfix.patches import by_id

pytestmark = pytest.mark.needs_vllm
needs_connector_patch = pytest.mark.applies("hidden-group-block-size")

MODULES = (
    "vllm.model_executor.models.extract_hidden_states",
    "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
)
IMPORT_TARGETS = f"""
import importlib
MODEL, CONN = (importlib.import_module(m) for m in {MODULES!r})
"""

# The scatter check on the live basic_cache: [] when padding goes to the null block.
SCATTER_OK = """
import torch
from vllm_hsfix import checks
def scatter_problems():
    case = checks.scratch_case(device="cpu", dtype=torch.float32)
    return checks.check_scatter(MODEL.basic_cache, case)
"""

HYBRID = """
import torch
from vllm.v1.kv_cache_interface import (FullAttentionSpec, HiddenStateCacheSpec,
    KVCacheConfig, KVCacheGroupSpec, MambaSpec)
def hybrid():
    groups = [
        KVCacheGroupSpec(["model.layers.3.self_attn"], FullAttentionSpec(
            block_size=528, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)),
        KVCacheGroupSpec(["model.layers.0.linear_attn"], MambaSpec(
            block_size=528, shapes=((4, 8),), dtypes=(torch.float32,))),
        KVCacheGroupSpec(["cache_only_layers.0"], HiddenStateCacheSpec(
            block_size=22, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)),
    ]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
"""

# A connector built before vllm-hsfix activates: vLLM imported, vllm_hsfix not yet.
EARLY_CONNECTOR = """
import json, tempfile
from types import SimpleNamespace as NS
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
transfer = KVTransferConfig(kv_connector="ExampleHiddenStatesConnector", kv_role="kv_both",
    kv_connector_extra_config={"shared_storage_path": tempfile.mkdtemp()})
vcfg = NS(kv_transfer_config=transfer, cache_config=NS(block_size=528),
          speculative_config=NS(draft_model_config=NS(hf_config=NS())))
"""


@needs_connector_patch
def test_connector_init_fails_closed_on_an_unexpected_error() -> None:
    """11.2: an unexpected error while resolving the group must stop the connector, not
    leave it reading with the global block size (the bug) behind a log line."""
    out = run_py(
        IMPORT_TARGETS
        + HYBRID
        + """
import json
import vllm_hsfix
from vllm_hsfix import checks
from vllm_hsfix.patches import hidden_group_block_size as connector
def broken(config):
    raise RuntimeError("injected fault in group resolution")
connector.find_hidden_group = broken
try:
    checks.construct_connector(CONN.ExampleHiddenStatesConnector, hybrid(), 528)
    raised = None
except Exception as exc:
    raised = [type(exc).__name__, str(exc)]
rec = vllm_hsfix.status()["patches"]["hidden-group-block-size"]
print(json.dumps([raised, rec["status"], rec["reason"]]))
"""
    )
    raised, status, reason = last_json(out.stdout)
    assert raised is not None, "the connector was built despite the failed resolution"
    assert raised[0] == "HsfixError"
    assert "VLLM_HSFIX_DISABLED_PATCHES=hidden-group-block-size" in raised[1]
    assert "injected fault" in raised[1]
    assert status == "failed" and "injected fault" in reason


@pytest.mark.applies("scatter-clamp")
def test_unapply_before_vllm_is_imported_sticks() -> None:
    """11.3: neither the import watcher nor vLLM's plugin call undoes unapply()."""
    out = run_py(
        """
import json, sys
import vllm_hsfix
vllm_hsfix.unapply()
"""
        + IMPORT_TARGETS
        + SCATTER_OK
        + """
from vllm.plugins import load_general_plugins
load_general_plugins()  # what every vLLM process does: calls our entry point
from vllm_hsfix.patches._wrap import ours_in
st = vllm_hsfix.status()
before = [st["activated_by"], {k: v["status"] for k, v in st["patches"].items()},
          ours_in(MODEL.basic_cache) is not None, bool(scatter_problems())]
vllm_hsfix.apply()
st = vllm_hsfix.status()["patches"]
print(json.dumps([before, st["scatter-clamp"]["status"], scatter_problems()]))
"""
    )
    before, after_apply, problems = last_json(out.stdout)
    sources, statuses, wrapped, release_bug_visible = before
    assert "vllm-import" in sources and "plugin" in sources
    assert set(statuses.values()) == {"reverted"}, statuses
    assert not wrapped and release_bug_visible
    assert after_apply == "applied" and problems == []


@pytest.mark.applies("scatter-clamp")
def test_reloaded_targets_are_reported_and_apply_repairs_them() -> None:
    """11.3: after importlib.reload a record must not say "applied"; apply() fixes it. A
    reload of the connector alone leaves the clamp's record (another module) applied."""
    out = run_py(
        """
import json, importlib
import vllm_hsfix
"""
        + IMPORT_TARGETS
        + SCATTER_OK
        + """
def statuses():
    return {k: [v["status"], v["code"]] for k, v in vllm_hsfix.status()["patches"].items()}
stamped = vllm_hsfix.status()["provenance"]
importlib.reload(CONN)
after_conn = statuses()
importlib.reload(MODEL)
after_both, bug_back = statuses(), bool(scatter_problems())
vllm_hsfix.apply()
print(json.dumps([stamped, after_conn, after_both, bug_back, statuses(),
                  vllm_hsfix.status()["provenance"], scatter_problems()]))
""",
        env=clean_env(VLLM_HSFIX_PROVENANCE="1"),
    )
    stamped, after_conn, after_both, bug_back, repaired, provenance, problems = last_json(
        out.stdout
    )
    assert after_conn["scatter-clamp"][0] == "applied", after_conn
    # Every row the table applies on the two reloaded modules (the clamp, and on 0.24.x
    # the connector's rows): overwritten by the reloads, applied again by apply().
    declared = declared_all()
    reloaded = [p for p in declared if declared[p] == "applied" and by_id(p).module in MODULES]
    assert "scatter-clamp" in reloaded
    for p in reloaded:
        assert after_both[p] == ["reverted", "overwritten"], p
        assert repaired[p][0] == "applied", (p, repaired[p])
    assert bug_back and problems == []
    # Provenance wraps the connector module's save_file, which 0.17-0.21 do not have.
    has_save_file = tuple(map(int, (RELEASE or "0.0.0").split(".")[:3])) >= (0, 22, 0)
    assert provenance is stamped and stamped is has_save_file


@needs_connector_patch
def test_apply_after_the_connector_exists_fixes_that_connector() -> None:
    """11.3: a connector built before activation is re-resolved, and status says so."""
    out = run_py(
        IMPORT_TARGETS
        + HYBRID
        + EARLY_CONNECTOR
        + """
conn = CONN.ExampleHiddenStatesConnector(vcfg, KVConnectorRole.WORKER, hybrid())
before = conn._block_size
import vllm_hsfix  # vLLM is imported: activates now, late
rec = vllm_hsfix.status()["patches"]["hidden-group-block-size"]
print(json.dumps([before, conn._block_size, rec["status"], rec["reason"]]))
conn._executor.shutdown(wait=False)
"""
    )
    before, after, status, reason = last_json(out.stdout)
    assert (before, after) == (528, 22)
    assert status == "applied"
    assert "1 connector(s) built before activation re-resolved (block size 528 -> 22)" in reason


def test_post_import_hooks_fire_once_after_the_module_body_ran(tmp_path: Path) -> None:
    """``_lazy.when_imported``: after the body, once, not on reload; at once for a
    module already imported; an exception in a hook reaches the import."""
    out = run_py(
        f"""
        import importlib, json, pathlib, sys
        pkg = pathlib.Path({str(tmp_path)!r})
        (pkg / "hsfix_target_a.py").write_text("VALUE = 1\\n")
        (pkg / "hsfix_target_b.py").write_text("VALUE = 2\\n")
        sys.path.insert(0, str(pkg))
        from vllm_hsfix import _lazy
        seen = []
        _lazy.when_imported("hsfix_target_a", lambda m: seen.append(("a", m.VALUE)))
        _lazy.when_imported("hsfix_target_a", lambda m: seen.append(("a2", m.VALUE)))
        import hsfix_target_a
        importlib.reload(hsfix_target_a)
        _lazy.when_imported("hsfix_target_a", lambda m: seen.append(("late", m.VALUE)))
        def boom(m):
            raise KeyError("from the hook")
        _lazy.when_imported("hsfix_target_b", boom)
        try:
            import hsfix_target_b
            raised = None
        except KeyError as exc:
            raised = str(exc)
        loader = type(hsfix_target_a.__loader__).__name__
        print(json.dumps([seen, raised, loader, _lazy.errors()]))
        """
    )
    assert out.returncode == 0, out.stderr[-2000:]
    seen, raised, loader, errors = last_json(out.stdout)
    assert seen == [["a", 1], ["a2", 1], ["late", 1]]
    assert raised == "'from the hook'"
    assert loader == "SourceFileLoader"  # no trace of the watcher's loader is left
    assert errors == []


def test_find_spec_does_not_activate_a_real_import_does() -> None:
    """11.6: transformers/TRL test for vLLM with find_spec; that must not load us."""
    out = run_py(
        """
import json, sys, importlib.util
import vllm_hsfix
found = importlib.util.find_spec("vllm") is not None
after_find = ["vllm_hsfix.runtime" in sys.modules, "vllm" in sys.modules]
import vllm
print(json.dumps([found, after_find, "vllm_hsfix.runtime" in sys.modules,
                  vllm_hsfix.status()["activated_by"],
                  type(vllm.__loader__).__name__, type(vllm.__spec__.loader).__name__]))
"""
    )
    found, after_find, after_import, sources, loader, spec_loader = last_json(out.stdout)
    assert found and after_find == [False, False]
    assert after_import and sources == ["import", "vllm-import"]
    assert "Activating" not in loader and "Activating" not in spec_loader


def test_an_error_inside_the_watcher_never_breaks_import_vllm() -> None:
    """11.6: e.g. a broken install of our runtime's dependencies."""
    out = run_py(
        """
import json, sys
import vllm_hsfix
sys.modules["vllm_hsfix.runtime"] = None  # importing it now raises ImportError
import vllm
from vllm_hsfix import _lazy
print(json.dumps(["vllm" in sys.modules, _lazy.errors()]))
"""
    )
    assert out.returncode == 0, out.stderr[-2000:]
    imported, errors = last_json(out.stdout)
    assert imported and errors and "vllm_hsfix.runtime" in errors[0]


def test_a_fork_while_another_thread_holds_the_lock_does_not_hang_the_child() -> None:
    """11.7: the lock held by a thread at fork() is fresh in the child."""
    out = run_py(
        """
import json, os, threading
from vllm_hsfix._lazy import LOCK
held, release, taken = threading.Event(), threading.Event(), threading.Event()
def holder():
    with LOCK:
        held.set()
        release.wait(10)
threading.Thread(target=holder, daemon=True).start()
held.wait(5)
pid = os.fork()
if pid == 0:
    def take():
        with LOCK:
            taken.set()
    threading.Thread(target=take, daemon=True).start()
    os._exit(0 if taken.wait(3) else 7)
_, status = os.waitpid(pid, 0)
release.set()
print(json.dumps([os.waitstatus_to_exitcode(status)]))
""",
        timeout=60,
    )
    assert last_json(out.stdout) == [0], out.stderr[-2000:]


@pytest.mark.applies("scatter-clamp")
def test_the_summary_line_goes_through_the_applications_logging() -> None:
    """11.8: an app's handler gets the line (once, its format), stderr does not; without
    a handler stderr gets it once (test_activation.py's first test)."""
    setup = (
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stdout, level=logging.INFO,"
        " format='APP|%(name)s|%(message)s')\n"
    )
    out = run_py(setup + "import vllm_hsfix\n" + IMPORT_TARGETS + "print('done')\n")
    ours = [ln for ln in out.stdout.splitlines() if "vllm-hsfix 0." in ln and "pid=" in ln]
    assert len(ours) == 1 and ours[0].startswith("APP|vllm_hsfix"), out.stdout[-2000:]
    assert "[vllm-hsfix] vllm-hsfix" not in out.stderr, out.stderr[-2000:]


@needs_connector_patch
def test_verify_goes_through_the_live_connector_class() -> None:
    """11.9: a wrapper that is installed but does nothing must not verify."""
    out = run_py(
        """
import json
import vllm_hsfix
"""
        + IMPORT_TARGETS
        + """
from vllm_hsfix import verify
from vllm_hsfix.patches._wrap import HsfixWrapper
# A broken wrapper: carries our mark, wraps once, but never resolves the group.
cls = CONN.ExampleHiddenStatesConnector
original = cls.__dict__["__init__"].__wrapped__
cls.__init__ = HsfixWrapper(original, lambda w, i, a, k: w(*a, **k), "hidden-group-block-size")
code, report = verify.run("cpu")
conn = [c for c in report["checks"] if c["check"].startswith("connector")][0]
print(json.dumps([code, conn["ok"], conn["problems"]]))
"""
    )
    code, ok, problems = last_json(out.stdout)
    assert code == 1 and not ok
    assert "'block_size': 528" in problems[0]


@pytest.mark.applies("scatter-clamp")
def test_unapply_leaves_a_later_wrapper_in_place_and_passes_through() -> None:
    """11.12: someone wrapped basic_cache after us; unapply must not clobber them."""
    out = run_py(
        """
import json, functools
import vllm_hsfix
"""
        + IMPORT_TARGETS
        + SCATTER_OK
        + """
calls = []
ours = MODEL.basic_cache
@functools.wraps(ours)
def theirs(*args, **kwargs):
    calls.append(1)
    return ours(*args, **kwargs)
MODEL.basic_cache = theirs
vllm_hsfix.unapply()
after_unapply = [MODEL.basic_cache is theirs, bool(scatter_problems()), len(calls),
                 vllm_hsfix.status()["patches"]["scatter-clamp"]["reason"]]
vllm_hsfix.apply()
print(json.dumps([after_unapply, MODEL.basic_cache is theirs, scatter_problems(), len(calls)]))
"""
    )
    after_unapply, still_theirs, problems, calls = last_json(out.stdout)
    kept, release_bug, n_calls, reason = after_unapply
    assert kept and release_bug and n_calls == 1  # theirs ran, ours passed through
    assert "pass-through beneath a later wrapper" in reason
    assert "was wrapped again" in out.stderr
    assert still_theirs and problems == [] and calls == 2


AMBIGUOUS = """
def ambiguous():
    # Two hidden-states groups: the fix's own ValueError (cannot tell which one).
    cfg = hybrid()
    cfg.kv_cache_groups.append(KVCacheGroupSpec(["cache_only_layers.1"], HiddenStateCacheSpec(
        block_size=22, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)))
    return cfg
"""


@needs_connector_patch
def test_a_late_apply_that_cannot_fix_an_existing_connector_takes_its_wrappers_back() -> None:
    """Issue 18.7: re-resolving a connector built before activation raises (ambiguous
    groups); the patch reports failed AND its wrappers are no longer on the class:
    never "failed" while live."""
    out = run_py(
        IMPORT_TARGETS
        + HYBRID
        + AMBIGUOUS
        + EARLY_CONNECTOR
        + """
try:
    conn = CONN.ExampleHiddenStatesConnector(vcfg, KVConnectorRole.WORKER, ambiguous())
except Exception as exc:  # 0.24.0's own __init__ may reject it already
    print(json.dumps(["init-raised", repr(exc)])); raise SystemExit(0)
import vllm_hsfix  # vLLM is imported: activates now, late
rec = vllm_hsfix.status()["patches"]["hidden-group-block-size"]
C = CONN.ExampleHiddenStatesConnector.__dict__
ids = [getattr(C[n], "hsfix_patch", None) for n in ("__init__", "register_kv_caches")]
print(json.dumps([rec["status"], rec["reason"], ids]))
conn._executor.shutdown(wait=False)
"""
    )
    result = last_json(out.stdout)
    assert result[0] != "init-raised", result
    status, reason, wrappers = result
    assert status == "failed" and "cannot identify the hidden-states KV-cache group" in reason
    # None of the failed patch's wrappers is left (the in-situ-verify extra may sit on
    # register_kv_caches: a row of patches.EXTRAS with a record of its own).
    assert "hidden-group-block-size" not in wrappers and wrappers[0] is None


@pytest.mark.applies("cpu-zero-blocks")
def test_verify_fails_when_the_cpu_zeroing_patch_is_refused() -> None:
    """Issue 18.7: ``verify`` covers every patch in range: someone else's no-op on the
    CPU runner makes the gate refuse cpu-zero-blocks, and verify is NOT verified."""
    out = run_py(
        """
import json
import vllm.v1.worker.cpu_model_runner as runner_module
def _zero_block_ids(self, block_ids):  # a foreign no-op, defined outside vLLM
    return None
runner_module.CPUModelRunner._zero_block_ids = _zero_block_ids
from vllm_hsfix import verify
code, report = verify.run("cpu")
print(json.dumps([code, report.get("error"), report["patches"]["cpu-zero-blocks"]["status"]]))
"""
    )
    code, error, status = last_json(out.stdout)
    assert (code, status) == (1, "refused"), out.stderr[-2000:]
    assert "cpu-zero-blocks" in error


def test_unapply_puts_back_every_replaced_attribute_and_apply_wraps_once() -> None:
    """Every attribute an applied patch replaced is the release's own object again after
    ``unapply()``, an added one is gone (the base class answers again), each record says
    reverted; ``apply()`` three times wraps each once, around that same original."""
    import contextlib
    import importlib

    import vllm_hsfix
    from vllm_hsfix.patches import PATCHES
    from vllm_hsfix.patches._wrap import ABSENT, ours_in, raw_attribute
    from vllm_hsfix.state import STATE

    for p in PATCHES:  # a row's module that this release lacks: that row is not applied
        with contextlib.suppress(ModuleNotFoundError):
            importlib.import_module(p.module)
    for _ in range(3):
        vllm_hsfix.apply()
    reps = {p: list(rec.replacements) for p, rec in STATE.records.items() if rec.replacements}
    assert reps, "no patch applied on this release"
    try:
        for pid, done in reps.items():
            for rep in done:
                ours = ours_in(raw_attribute(rep.owner, rep.name), pid)
                assert ours is not None, (pid, rep.name)
                if rep.original is not ABSENT:  # an added method wraps our own body
                    assert ours.__wrapped__ is rep.original, (pid, rep.name)
                    assert ours_in(rep.original, pid) is None, (pid, rep.name)  # once
        vllm_hsfix.unapply()
        for pid, done in reps.items():
            assert STATE.records[pid].status == "reverted", pid
            for rep in done:
                if rep.original is ABSENT:
                    assert rep.name not in vars(rep.owner), (pid, rep.name)
                else:
                    assert raw_attribute(rep.owner, rep.name) is rep.original, (pid, rep.name)
        vllm_hsfix.apply()
        for pid, done in reps.items():
            for rep in done:
                assert ours_in(raw_attribute(rep.owner, rep.name), pid) is not None, pid
    finally:
        vllm_hsfix.unapply()
