"""The patcher fails closed, reverts for good, reports the truth, and survives fork, reload,
late activation, other wrappers and logging; its post-import hooks fire once."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import CONNECTOR_MODULE, MODEL_MODULE, clean_env, declared_all, last_json
from support.procs import child, child_json

from vllm_hsfix.patches import by_id

pytestmark = pytest.mark.needs_vllm
needs_connector_patch = pytest.mark.applies("hidden-group-block-size")
MODULES = (MODEL_MODULE, CONNECTOR_MODULE)


@needs_connector_patch
def test_connector_init_fails_closed_on_an_unexpected_error() -> None:
    """An unexpected error while resolving the group must stop the connector, not
    leave it reading with the global block size (the bug) behind a log line."""
    raised, status, reason = child_json("hardening.py", "fails_closed")
    assert raised is not None, "the connector was built despite the failed resolution"
    assert raised[0] == "HsfixError"
    assert "VLLM_HSFIX_DISABLED_PATCHES=hidden-group-block-size" in raised[1]
    assert "injected fault" in raised[1]
    assert status == "failed" and "injected fault" in reason


@pytest.mark.applies("scatter-clamp")
def test_unapply_before_vllm_is_imported_sticks() -> None:
    """Neither the import watcher nor vLLM's plugin call undoes unapply()."""
    before, after_apply, problems = child_json("hardening.py", "unapply_before_import")
    sources, statuses, wrapped, release_bug_visible = before
    assert "vllm-import" in sources and "plugin" in sources
    assert set(statuses.values()) == {"reverted"}, statuses
    assert not wrapped and release_bug_visible
    assert after_apply == "applied" and problems == []


@pytest.mark.applies("scatter-clamp")
def test_reloaded_targets_are_reported_and_apply_repairs_them() -> None:
    """After importlib.reload a record must not say "applied"; apply() fixes it. A
    reload of the connector alone leaves the clamp's record (another module) applied."""
    got = child_json("hardening.py", "reload_targets", env=clean_env(VLLM_HSFIX_PROVENANCE="1"))
    stamped, after_conn, after_both, bug_back, repaired, provenance, problems = got
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
    # Provenance wraps the connector module's save_file where it has one (0.22.0 on).
    assert stamped == [provenance, provenance], (stamped, provenance)


@needs_connector_patch
def test_apply_after_the_connector_exists_fixes_that_connector() -> None:
    """A connector built before ``apply()`` is re-resolved, and status says so."""
    before, after, status, reason = child_json("hardening.py", "apply_after_connector")
    assert (before, after) == (528, 22)
    assert status == "applied"
    assert "1 connector(s) built before activation re-resolved (block size 528 -> 22)" in reason


def test_post_import_hooks_fire_once_after_the_module_body_ran(tmp_path: Path) -> None:
    """``_lazy.when_imported``: after the body, once, not on reload; at once for a
    module already imported; an exception in a hook reaches the import."""
    seen, raised, loader, errors = child_json("hardening.py", "post_import_hooks", str(tmp_path))
    assert seen == [["a", 1], ["a2", 1], ["late", 1]]
    assert raised == "'from the hook'"
    assert loader == "SourceFileLoader"  # no trace of the watcher's loader is left
    assert errors == []


def test_find_spec_does_not_activate_a_real_import_does() -> None:
    """transformers and TRL look for vLLM with find_spec: that must not load us."""
    found, after_find, after_import, sources, *loaders = child_json("hardening.py", "find_spec")
    assert found and after_find == [False, False]
    assert after_import and sources == ["import", "vllm-import"]
    assert not any("Activating" in name for name in loaders), loaders


def test_an_error_inside_the_watcher_never_breaks_import_vllm() -> None:
    """E.g. a broken install of our runtime's dependencies."""
    imported, errors = child_json("hardening.py", "broken_runtime")
    assert imported and errors and "vllm_hsfix.runtime" in errors[0]


def test_a_fork_while_another_thread_holds_the_lock_does_not_hang_the_child() -> None:
    """The lock held by a thread at fork() is fresh in the child."""
    assert child_json("hardening.py", "fork_with_lock_held") == [0]


@pytest.mark.applies("scatter-clamp")
def test_the_summary_line_goes_through_the_applications_logging() -> None:
    """An app's handler gets the line (once, its format), stderr does not; without
    a handler stderr gets it once (test_activation.py's first test)."""
    out = child("hardening.py", "app_logging")
    ours = [ln for ln in out.stdout.splitlines() if "vllm-hsfix 0." in ln and "pid=" in ln]
    assert len(ours) == 1 and ours[0].startswith("APP|vllm_hsfix"), out.stdout[-2000:]
    assert "[vllm-hsfix] vllm-hsfix" not in out.stderr, out.stderr[-2000:]


@needs_connector_patch
def test_verify_goes_through_the_live_connector_class() -> None:
    """A wrapper that is installed but does nothing must not verify."""
    code, ok, problems = child_json("hardening.py", "verify_broken_wrapper")
    assert code == 1 and not ok
    assert "'block_size': 528" in problems[0]


@pytest.mark.applies("scatter-clamp")
def test_unapply_leaves_a_later_wrapper_in_place_and_passes_through() -> None:
    """Someone wrapped basic_cache after us; unapply must not clobber them."""
    out = child("hardening.py", "later_wrapper")
    after_unapply, still_theirs, problems, calls = last_json(out.stdout)
    kept, release_bug, n_calls, reason = after_unapply
    assert kept and release_bug and n_calls == 1  # theirs ran, ours passed through
    assert "pass-through beneath a later wrapper" in reason
    assert "was wrapped again" in out.stderr
    assert still_theirs and problems == [] and calls == 2


@needs_connector_patch
def test_a_late_apply_that_cannot_fix_an_existing_connector_takes_its_wrappers_back() -> None:
    """A late apply that cannot re-resolve a connector reports failed, its wrappers off."""
    result = child_json("hardening.py", "late_apply_ambiguous")
    assert result[0] != "init-raised", result
    status, reason, wrappers = result
    assert status == "failed" and "cannot identify the hidden-states KV-cache group" in reason
    # None of the failed patch's wrappers is left (the observer extra may sit on
    # register_kv_caches: a row of patches.EXTRAS with a record of its own).
    assert "hidden-group-block-size" not in wrappers and wrappers[0] is None


@pytest.mark.applies("cpu-zero-blocks")
def test_verify_fails_when_the_cpu_zeroing_patch_is_refused() -> None:
    """``verify`` covers every patch in range: someone else's no-op on the
    CPU runner makes the gate refuse cpu-zero-blocks, and verify is NOT verified."""
    code, error, status = child_json("hardening.py", "foreign_cpu_zeroing")
    assert (code, status) == (1, "refused"), error
    assert "cpu-zero-blocks" in error


def test_unapply_puts_back_every_replaced_attribute_and_apply_wraps_once() -> None:
    """``unapply()`` puts back every replaced attribute, removes added ones and records
    reverted; ``apply()`` three times wraps each once, around the same original."""
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
        # Rows that wrap one attribute (0.22's save_kv_layer: three) chain: each wraps the
        # one before; unapply() must put back the release's own, beneath them all.
        ours = {  # each replacement's own object: a wrapper, or a swapped-in function
            id(getattr(rep, "wrapper", None) or getattr(rep, "replacement", None))
            for done in reps.values()
            for rep in done
        }
        release_own = {  # what the first row in each chain found there
            (id(rep.owner), rep.name): rep.original
            for done in reps.values()
            for rep in done
            if rep.original is not ABSENT and id(rep.original) not in ours
        }
        vllm_hsfix.unapply()
        for pid, done in reps.items():
            assert STATE.records[pid].status == "reverted", pid
            for rep in done:
                if rep.original is ABSENT:
                    assert rep.name not in vars(rep.owner), (pid, rep.name)
                else:
                    want = release_own[(id(rep.owner), rep.name)]
                    assert raw_attribute(rep.owner, rep.name) is want, (pid, rep.name)
        vllm_hsfix.apply()
        for pid, done in reps.items():
            for rep in done:
                assert ours_in(raw_attribute(rep.owner, rep.name), pid) is not None, pid
    finally:
        vllm_hsfix.unapply()
