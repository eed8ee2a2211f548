"""The live runtime: decide and patch each target as vLLM imports it, revert, report.

Every activation path (``import vllm_hsfix``, the vLLM plugin, the sitecustomize
bootstrap, ``apply()``) ends in :func:`start`. Patching happens in post-import hooks
on the target modules (``_lazy.when_imported``: wrapt's contract, without loading
wrapt into processes that never import a target), so it is right whether vLLM was
imported before or after activation. For each target the flow is one way:

    detect (``detect``) -> plan (``plan.decide``) -> patch (``patches.<id>.apply``)
    -> report (``report``)

Failures are recorded and logged, never raised, unless strict mode is on. The
runtime hands the patches their callbacks (``patches.hooks.Hooks``); nothing below
imports this module.

Start-up cost: vLLM's plugin starts the runtime in every process it creates, and most
of them never import a target module. So what only a target import needs (the
patches, wrapt, the checks, provenance) is imported where it is first used
(``benchmarks/bench_startup.py`` measures the plugin against a process without it).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from functools import cache
from types import ModuleType
from typing import TYPE_CHECKING, Any

from . import _lazy, config, detect, plan, report
from .errors import HsfixError
from .patches import MODULES, PATCH_IDS, PATCHES
from .state import (
    APPLIED,
    ARMED,
    FAILED,
    LOCK,
    PENDING,
    REFUSED,
    REVERTED,
    STATE,
    UNDECIDED,
    Record,
)

if TYPE_CHECKING:
    from .hazards import Hazard
    from .patches.hooks import Hooks

log = logging.getLogger(__name__)

__all__ = ["HsfixError", "internal_error", "start", "status", "unapply"]


def _init_locked() -> config.Config:
    if STATE.config is None:
        cfg = config.load(known_patches=PATCH_IDS)
        STATE.config = cfg
        report.setup_logging(cfg)
        STATE.records = {p.id: Record(p) for p in PATCHES}
        for w in cfg.warnings:
            log.warning(w)
        atexit.register(_at_exit)
    return STATE.config


def install() -> detect.VllmInstall:
    """What detection found (once per process; never raises)."""
    with LOCK:
        cfg = _init_locked()
        if STATE.install is None:
            try:
                STATE.install = detect.detect(cfg.vllm_version_override)
            except Exception as exc:
                STATE.install = detect.VllmInstall(
                    present=False, source="error", problem=f"vLLM detection failed: {exc!r}"
                )
                internal_error(STATE.install.problem or "", exc)
        return STATE.install


def _plugins_warning() -> None:
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is None:
        return
    names = [n.strip() for n in allowed.split(",")]
    if "vllm_hsfix" not in names:
        log.warning(
            "VLLM_PLUGINS=%r leaves out 'vllm_hsfix': processes vLLM starts (engine core, "
            "workers) will NOT be patched unless they import vllm_hsfix themselves or run "
            "under the sitecustomize bootstrap; add vllm_hsfix to VLLM_PLUGINS",
            allowed,
        )


def start(source: str) -> None:
    """Entry point of every activation path. Idempotent and thread-safe.

    After :func:`unapply`, only ``source == "apply"`` (the user's explicit call)
    patches again; the plugin, the import watcher and the bootstrap keep out.
    """
    try:
        with LOCK:
            cfg = _init_locked()
            _lazy.record_source(source)
            if STATE.unapplied and source != "apply":
                _report()
                return
            STATE.unapplied = False
            _refresh()
            if not cfg.disabled and not STATE.enabled and not STATE.hooks_registered:
                _plugins_warning()
            STATE.enabled = not cfg.disabled
            _plan_ahead(cfg)
            if STATE.enabled:
                # Targets imported before (or reverted since): decide now, as a late patch.
                for name in MODULES:
                    module = sys.modules.get(name)
                    if module is not None:
                        _on_import(module, late=True)
                _register_hooks()
            _report()
    except HsfixError:
        raise
    except Exception as exc:  # never into the user's program
        internal_error(f"activation from {source} failed: {exc!r}", exc)


def _plan_ahead(cfg: config.Config) -> None:
    """Decide every undecided patch now, so the process's line can be logged at
    activation: what needs no look at the code (release, platform, switches) is
    final; a patch that needs its target's shape is ``armed``: the shape gate runs on
    the live module when it is imported. Not on the file now: parsing and
    fingerprinting the target files cost every vLLM process tens of milliseconds,
    most of them never import a target (``vllm-hsfix status`` still reads the files)."""
    inst = install()
    for rec in STATE.records.values():
        if rec.code not in (UNDECIDED, ARMED):
            continue
        if inst.source == "error":
            rec.set("error", inst.problem or "vLLM detection failed")
            continue
        decision = plan.without_probe(rec.patch, inst, cfg)
        if decision is None:
            rec.set("armed", f"vLLM {inst.version}: in range; shape checked on import")
            continue
        rec.set(decision.code, decision.reason)
        if rec.status == REFUSED:
            log.warning("%s refused: %s", rec.patch.id, rec.reason)


def internal_error(message: str, exc: BaseException | None = None) -> None:
    """Record and log an error of the package itself; raise only in strict mode."""
    STATE.errors.append(message)
    try:
        cfg = _init_locked()
    except Exception:
        cfg = config.load()
    log.error(message, exc_info=exc is not None and log.isEnabledFor(logging.DEBUG))
    if cfg.strict:
        raise HsfixError(message) from exc


def _register_hooks() -> None:
    if STATE.hooks_registered:
        return
    for name in MODULES:
        _lazy.when_imported(name, _on_import)
    STATE.hooks_registered = True


def _on_import(module: ModuleType, late: bool = False) -> None:
    with LOCK:
        if not STATE.enabled or STATE.unapplied:
            return
        for rec in STATE.records.values():
            if rec.patch.module == module.__name__ and rec.status in (PENDING, REVERTED):
                _decide(rec, module, late)
                if rec.status in (REFUSED, FAILED):
                    report.deviation(rec)
        _maybe_observe()
        _maybe_provenance()
        _maybe_refuse_config(module)
        _report()
        cfg = STATE.config
        if cfg is not None and cfg.strict:
            bad = [r for r in STATE.records.values() if r.status in (REFUSED, FAILED)]
            if bad:
                raise HsfixError(
                    "strict mode: " + "; ".join(f"{r.patch.id} {r.status}: {r.reason}" for r in bad)
                )


def _decide(rec: Record, module: ModuleType, late: bool) -> None:
    cfg = STATE.config
    assert cfg is not None
    patch = rec.patch
    try:
        inst = install()
        if inst.source == "error":
            rec.set("error", inst.problem or "vLLM detection failed")
            return
        impl = patch.implementation()
        decision = plan.decide(patch, inst, cfg, lambda: impl.probe(module))
        if decision.probe is not None:
            rec.shape = decision.probe.shape
            rec.fingerprints = dict(decision.probe.fingerprints)
        if decision.code != plan.APPLY:
            rec.set(decision.code, decision.reason)
            if rec.status == REFUSED:
                log.warning("%s refused: %s", patch.id, rec.reason)
            return
        assert rec.shape is not None
        rec.replacements = impl.apply(module, rec.shape, hooks())
        reason = decision.reason
        adopt = getattr(impl, "adopt", None)
        if late and adopt is not None:
            note = adopt(module)
            reason += f"; {note}" if note else ""
        rec.set("applied", reason)
    except Exception as exc:
        # Never "failed" with wrappers live: take back whatever was installed.
        for rep in reversed(rec.replacements):
            try:
                rep.restore()
            except Exception as undo:
                STATE.errors.append(f"{patch.id}: could not take back a wrapper: {undo!r}")
        rec.replacements = []
        rec.set("error", f"{type(exc).__name__}: {exc}")
        log.error("%s failed: %s", patch.id, rec.reason, exc_info=log.isEnabledFor(logging.DEBUG))


def _live_owner(owner: object) -> bool:
    """``owner`` (a module or a class) is still what its import path leads to, not an
    old object left behind by ``importlib.reload``."""
    if isinstance(owner, ModuleType):
        return sys.modules.get(owner.__name__) is owner
    module = sys.modules.get(getattr(owner, "__module__", ""))
    return module is not None and getattr(module, getattr(owner, "__name__", ""), None) is owner


def _refresh() -> None:
    """Make the records true again: an applied patch whose wrapper is no longer what
    the target's path leads to (module reloaded, attribute reassigned) is marked."""
    for rec in STATE.records.values():
        if rec.status != APPLIED:
            continue
        stale = [r for r in rec.replacements if not (r.live() and _live_owner(r.owner))]
        if stale:
            names = ", ".join(f"{getattr(r.owner, '__name__', r.owner)}.{r.name}" for r in stale)
            rec.replacements = []
            rec.set(
                "overwritten",
                f"the patched {names} was replaced after patching (module reloaded or "
                "attribute reassigned); vllm_hsfix.apply() patches it again",
            )


def _on_failure(patch_id: str, exc: BaseException) -> None:
    with LOCK:
        rec = STATE.records.get(patch_id)
        if rec is not None:
            rec.set("error", f"at run time: {type(exc).__name__}: {exc}")
        STATE.errors.append(f"{patch_id} failed at run time: {exc!r}")
        report.write_status_file()
    log.error("%s failed at run time: %r", patch_id, exc)


def _after_register(connector: Any) -> None:
    """The in-situ checks, once per process, when a worker registers its KV caches:
    every applied patch that declares one (``in_situ`` in its module) runs it. Also
    notes the connector's aux layer ids (provenance stamps them)."""
    from . import provenance

    STATE.aux_layers = provenance.aux_layers(connector)
    STATE.engine = provenance.engine_settings(connector)
    cfg = STATE.config
    if cfg is None or not cfg.verify or STATE.verify is not None:
        return
    results = []
    for rec in list(STATE.records.values()):
        in_situ = getattr(rec.patch.implementation(), "in_situ", None)
        if rec.status == APPLIED and in_situ is not None:
            result = in_situ(connector)
            if result is not None:
                results.append({"patch": rec.patch.id, **result})
    if not results:
        return
    result = results[0] if len(results) == 1 else _merge(results)
    with LOCK:
        STATE.verify = result
        report.write_status_file()
    log.log(
        logging.INFO if result["ok"] else logging.ERROR,
        "in-situ check %s on %s %s in %s ms%s",
        "passed" if result["ok"] else "FAILED",
        result.get("device"),
        result.get("dtype"),
        result.get("ms"),
        "" if result["ok"] else f": {result['problems']}",
    )
    if not result["ok"] and cfg.strict:
        raise HsfixError(f"in-situ check failed: {result['problems']}")


def _merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "ok": all(r["ok"] for r in results),
        "problems": [f"{r['patch']}: {p}" for r in results for p in r.get("problems", [])],
        "device": results[0].get("device"),
        "dtype": results[0].get("dtype"),
        "ms": round(sum(r.get("ms") or 0 for r in results), 3),
        "checks": results,
    }


@cache
def hooks() -> Hooks:
    """The callbacks the patches get, built when a patch is first applied."""
    from .patches.hooks import Hooks

    return Hooks(on_failure=_on_failure, after_register=_after_register)


def _maybe_observe() -> None:
    """Where an applied patch has an in-situ check but no applied patch wraps the
    connector's ``register_kv_caches`` itself (0.17-0.23: only the clamp), hook a pure
    observer there so the check still runs when a worker registers its caches."""
    from . import checks
    from .patches import hidden_group_block_size as connector_patch

    cfg = STATE.config
    module = sys.modules.get(checks.CONNECTOR_MODULE)
    if module is None or cfg is None or not cfg.verify:
        return
    applied = [r for r in STATE.records.values() if r.status == APPLIED]
    if not any(getattr(r.patch.implementation(), "in_situ", None) for r in applied):
        return
    # Only a patch that declares it runs hooks.after_register itself makes the observer
    # unnecessary; other patches on the connector module (abort-before-scheduling,
    # atomic-writes, cpu-connector-save) wrap other methods.
    calls_it = [
        r
        for r in STATE.records.values()
        if r.patch.module == checks.CONNECTOR_MODULE
        and getattr(r.patch.implementation(), "CALLS_AFTER_REGISTER", False)
    ]
    if any(r.status in (APPLIED, PENDING) for r in calls_it):
        return  # the connector patch calls after_register itself (or is about to be applied)
    if any(rep.wrapper.hsfix_patch == "in-situ-verify" for r in applied for rep in r.replacements):
        return
    try:
        rep = connector_patch.observe(module, hooks())
        if rep is not None:
            applied[0].replacements.append(rep)
    except Exception as exc:
        log.warning("in-situ check not hooked: %r", exc)


def _maybe_provenance() -> None:
    """With VLLM_HSFIX_PROVENANCE=1 and a patch applied, stamp the files the connector saves."""
    from . import checks, provenance

    cfg = STATE.config
    module = sys.modules.get(checks.CONNECTOR_MODULE)
    applied = [r for r in STATE.records.values() if r.status == APPLIED]
    if module is None or cfg is None or not cfg.provenance or not applied:
        return
    if any(r.wrapper.hsfix_patch == provenance.PATCH_ID for a in applied for r in a.replacements):
        return
    try:
        rep = provenance.install(module, report.provenance_metadata)
        if rep is not None:
            applied[-1].replacements.append(rep)
            STATE.provenance = True
    except Exception as exc:
        log.warning("provenance metadata not hooked: %r", exc)


def _maybe_refuse_config(module: ModuleType) -> None:
    """Where the release has hazards whose trigger is a setting (the register's
    ``refuse-config`` rows), wrap the connector's ``__init__`` to check them when the
    scheduler's connector is built (``refuse_config``)."""
    from . import hazards, refuse_config

    inst = STATE.install
    if module.__name__ != refuse_config.MODULE or inst is None or not inst.release:
        return
    if STATE.config_check is not None and STATE.config_check.live():
        return
    rows = hazards.refuse_config(inst.release)
    try:
        rep = refuse_config.install(
            module, rows, inst.release, _on_config_hazard, _on_config_check_error
        )
    except Exception as exc:
        internal_error(f"refuse-config check not installed: {exc!r}", exc)
        return
    STATE.config_check = rep
    STATE.config_checked = tuple(h.id for h in rows) if rep is not None else ()


def _on_config_hazard(hazard: Hazard, message: str) -> None:
    """A setting at engine start triggers a hazard: one WARNING; strict mode refuses
    to start (the exception leaves the connector's __init__, so the engine fails)."""
    from .config import STRICT

    with LOCK:
        STATE.config_hazards[hazard.id] = message
        report.write_status_file()
        cfg = STATE.config
    if cfg is not None and cfg.strict:
        log.error("%s", message)
        raise HsfixError(
            f"strict mode ({STRICT}=1): refusing to start: {message} "
            f"(or run without {STRICT}=1 to start with this WARNING)"
        )
    log.warning("%s", message)


def _on_config_check_error(exc: BaseException) -> None:
    internal_error(f"refuse-config check failed: {exc!r}", exc)


def unapply() -> None:
    """Stop patching in this process, for good unless :func:`start` is called with
    "apply": every wrapper is switched to pass-through and, where it is still the
    outermost, the original object is put back."""
    with LOCK:
        _init_locked()
        STATE.enabled = False
        STATE.unapplied = True
        for rec in STATE.records.values():
            results = [rep.restore() for rep in reversed(rec.replacements)]
            if rec.replacements:
                kept = results.count("pass-through")
                rec.set(
                    "reverted",
                    "unapply() restored the original objects"
                    + (f" ({kept} left as pass-through beneath a later wrapper)" if kept else ""),
                )
                rec.replacements = []
            elif rec.status == PENDING:
                rec.set(
                    "reverted",
                    "unapply() was called before the target was imported: it stays "
                    "unpatched in this process unless apply() is called",
                )
        STATE.provenance = False
        if STATE.config_check is not None:
            STATE.config_check.restore()
            STATE.config_check = None
            STATE.config_checked = ()
        report.write_status_file()


def status() -> dict[str, Any]:
    """The true state of this process (records checked against the live targets)."""
    with LOCK:
        _init_locked()
        install()
        _refresh()
        return report.status_dict()


def _report() -> None:
    report.write_status_file()
    report.log_summary_once()


def _forked_child() -> None:
    """A forked child (vLLM's workers and engine core by default) is a process of its
    own: it logs its own line and runs its own in-situ check."""
    STATE.logged = False
    STATE.verify = None


os.register_at_fork(after_in_child=_forked_child)


def _at_exit() -> None:
    try:
        with LOCK:
            report.at_exit()
    except Exception:
        pass
