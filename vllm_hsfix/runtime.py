"""The live runtime: decide and patch each target as vLLM imports it, revert, report.

Every activation path ends in :func:`start`; post-import hooks run detect ->
``plan.decide`` -> ``apply`` -> ``report``. Failures are logged, raised only in strict mode.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import sys
from functools import cache
from types import ModuleType
from typing import TYPE_CHECKING, Any

from . import _lazy, config, detect, plan, report, views
from ._lazy import LOCK
from .codes import APPLIED, FAILED, IN_PLACE, ON_IMPORT, REFUSED, REVERTED, Code
from .errors import HsfixError
from .patches import CONNECTOR, EXTRAS, MODULES, PATCH_IDS, PATCHES
from .state import STATE, Record

if TYPE_CHECKING:
    from .patches.hooks import Hooks

log = logging.getLogger(__name__)

__all__ = ["HsfixError", "internal_error", "start", "status", "unapply"]


def _init_locked() -> config.Config:
    if STATE.config is None:
        cfg = config.load(known_patches=PATCH_IDS)
        STATE.config = cfg
        report.setup_logging(cfg)
        STATE.records = {p.id: Record(p) for p in PATCHES}
        STATE.extras = {e.id: None for e in EXTRAS}
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
                problem = f"vLLM detection failed: {exc!r}"
                STATE.install = detect.VllmInstall(present=False, source="error", problem=problem)
                internal_error(problem, exc)
        return STATE.install


def _plugins_warning() -> None:
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and "vllm_hsfix" not in [n.strip() for n in allowed.split(",")]:
        log.warning(
            "VLLM_PLUGINS=%r leaves out 'vllm_hsfix': processes vLLM starts (engine core, "
            "workers) will NOT be patched unless they import vllm_hsfix themselves or run "
            "under the sitecustomize bootstrap; add vllm_hsfix to VLLM_PLUGINS",
            allowed,
        )


def start(source: str) -> None:
    """Entry point of every activation path. Idempotent and thread-safe. After
    :func:`unapply`, only ``source == "apply"`` (the user's explicit call) patches again."""
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
            _plan_ahead()
            if STATE.enabled:
                for name in MODULES:  # targets imported before (or reverted since)
                    if name in sys.modules:
                        _on_import(sys.modules[name], late=True)
                if not STATE.hooks_registered:
                    for name in MODULES:
                        _lazy.when_imported(name, _on_import)
                    STATE.hooks_registered = True
            _report()
    except HsfixError:
        raise
    except Exception as exc:  # never into the user's program
        internal_error(f"activation from {source} failed: {exc!r}", exc)


def _plan_ahead() -> None:
    """Decide now what needs no look at the code, so the line is logged at activation;
    the rest is ``armed`` (parsing files here would cost every vLLM process)."""
    inst = install()
    for rec in STATE.records.values():
        if rec.code not in (Code.WAITING, Code.ARMED):
            continue
        decision = plan.release_gate(rec.patch, inst, STATE.config)  # type: ignore[arg-type]
        if decision is None:
            why = "no upstream fix known" if rec.patch.fixed_in is None else "in range"
            rec.set(Code.ARMED, f"vLLM {inst.version}: {why}; shape checked on import")
        else:
            _set(rec, decision.code, decision.reason)


def _set(rec: Record, code: Code, reason: str) -> None:
    rec.set(code, reason)
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


def _on_import(module: ModuleType, late: bool = False) -> None:
    with LOCK:
        if not STATE.enabled or STATE.unapplied:
            return
        for rec in STATE.records.values():
            if rec.patch.module == module.__name__ and rec.status in (ON_IMPORT, REVERTED):
                _decide(rec, module, late)
                if rec.status in (REFUSED, FAILED):
                    report.deviation(rec)
        _install_extras()
        _report()
        bad = views.records_not_in_place()  # the one policy: status and verify use it too
        if bad and STATE.config is not None and STATE.config.strict:
            raise HsfixError("strict mode: the fix cannot apply: " + "; ".join(bad))


def _decide(rec: Record, module: ModuleType, late: bool) -> None:
    patch = rec.patch
    try:
        impl = patch.implementation()
        decision = plan.decide(patch, install(), STATE.config, lambda: impl.probe(module))  # type: ignore[arg-type]
        if decision.probe is not None:
            rec.shape = decision.probe.shape
            rec.fingerprints = dict(decision.probe.fingerprints)
        if decision.code != Code.APPLY:
            _set(rec, decision.code, decision.reason)
            return
        assert rec.shape is not None
        rec.replacements = impl.apply(module, rec.shape, hooks())
        adopt = getattr(impl, "adopt", None) if late else None
        note = adopt(module) if adopt is not None else None
        rec.set(Code.APPLIED, decision.reason + (f"; {note}" if note else ""))
    except Exception as exc:
        # Never "failed" with wrappers live: take back whatever was installed.
        for rep in reversed(rec.replacements):
            try:
                rep.restore()
            except Exception as undo:
                STATE.errors.append(f"{patch.id}: could not take back a wrapper: {undo!r}")
        rec.replacements = []
        rec.set(Code.ERROR, f"{type(exc).__name__}: {exc}")
        log.error("%s failed: %s", patch.id, rec.reason, exc_info=log.isEnabledFor(logging.DEBUG))


def _reachable(rep: Any) -> bool:
    """The wrapper is in place, on an owner (module or class) that is still what its
    import path leads to, not an old object left behind by ``importlib.reload``."""
    owner = rep.owner
    if isinstance(owner, ModuleType):
        current: object = sys.modules.get(owner.__name__)
    else:
        module = sys.modules.get(getattr(owner, "__module__", ""))
        current = getattr(module, getattr(owner, "__name__", ""), None)
    return current is owner and bool(rep.in_effect())


def _refresh() -> None:
    """Mark an applied patch whose wrapper is no longer what the target's path leads
    to (module reloaded, attribute reassigned); forget such an extra's wrapper."""
    for rec in STATE.records.values():
        stale = [r for r in rec.replacements if not _reachable(r)] if rec.status == APPLIED else []
        if stale:
            names = ", ".join(f"{getattr(r.owner, '__name__', r.owner)}.{r.name}" for r in stale)
            rec.replacements = []
            rec.set(
                Code.OVERWRITTEN,
                f"the patched {names} was replaced after patching (module reloaded or "
                "attribute reassigned); vllm_hsfix.apply() patches it again",
            )
    for extra_id, rep in STATE.extras.items():
        if rep is not None and not _reachable(rep):
            STATE.extras[extra_id] = None  # installed again on the next target import


def _on_failure(patch_id: str, exc: BaseException) -> None:
    with LOCK:
        rec = STATE.records.get(patch_id)
        if rec is not None:
            rec.set(Code.ERROR, f"at run time: {type(exc).__name__}: {exc}")
        STATE.errors.append(f"{patch_id} failed at run time: {exc!r}")
        report.write_status_file()
    log.error("%s failed at run time: %r", patch_id, exc)


def _after_register(connector: Any) -> None:
    """Once per process, when a worker registers its KV caches (the ``observer`` extra):
    note what provenance stamps, and run the in-situ check of every applied patch that
    has one."""
    from . import provenance

    STATE.aux_layers = provenance.aux_layers(connector)
    STATE.engine = provenance.engine_settings(connector)
    cfg = STATE.config
    if cfg is None or not cfg.verify or STATE.verify is not None:
        return
    results = []
    for rec in list(STATE.records.values()):
        in_situ = getattr(rec.patch.implementation(), "in_situ", None)
        found = in_situ(connector) if rec.status == APPLIED and in_situ is not None else None
        if found is not None:
            results.append({"patch": rec.patch.id, **found})
    if not results:
        return
    result = results[0] if len(results) == 1 else _merge(results)
    with LOCK:
        STATE.verify = result
        report.write_status_file()
    ok = result["ok"]
    log.log(
        logging.INFO if ok else logging.ERROR,
        "in-situ check %s on %s %s in %s ms%s",
        "passed" if ok else "FAILED",
        result.get("device"),
        result.get("dtype"),
        result.get("ms"),
        "" if ok else f": {result['problems']}",
    )
    if not ok and cfg.strict:
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

    return Hooks(on_failure=_on_failure, in_place=_in_place)


def _in_place(patch_id: str) -> bool:
    """The row is applied here, or its target, not imported yet, would be patched as
    ``status`` decides it from the file."""
    with LOCK:
        rec = STATE.records.get(patch_id)
        if rec is None or rec.code not in IN_PLACE:
            return False
        if rec.code == Code.APPLIED:
            return True
        return plan.decide_from_file(rec.patch, install(), STATE.config).code == Code.APPLY  # type: ignore[arg-type]


def _install_extras() -> None:
    """Install each extra (``patches.EXTRAS``) whose ``wanted`` holds, once the connector
    module is imported, unless its wrapper is in effect. A failure never stops a patch:
    a required extra's is the package's error, another's a WARNING."""
    module, cfg = sys.modules.get(CONNECTOR), STATE.config
    if module is None or cfg is None:
        return
    from .patches.hooks import ExtraContext

    ctx = ExtraContext(
        config=cfg,
        release=(STATE.install.release if STATE.install else None) or "",
        applied=tuple(r.patch for r in STATE.records.values() if r.status == APPLIED),
        after_register=_after_register,
        on_error=internal_error,
        metadata=report.provenance_metadata,
    )
    for extra in EXTRAS:
        rep = STATE.extras.get(extra.id)
        if rep is not None and rep.in_effect():
            continue
        try:
            impl = importlib.import_module(extra.impl)
            STATE.extras[extra.id] = impl.install(module, ctx) if impl.wanted(ctx) else None
        except Exception as exc:
            STATE.extras[extra.id] = None
            if extra.required:
                internal_error(f"{extra.id} check not installed: {exc!r}", exc)
            else:
                log.warning("%s not hooked: %r", extra.id, exc)


def unapply() -> None:
    """Stop patching in this process until :func:`start` is called with "apply": every
    wrapper passes through, and the original is put back where ours is outermost."""
    with LOCK:
        _init_locked()
        STATE.enabled = False
        STATE.unapplied = True
        # Extras first: they were installed over the patches (last in, first out).
        for extra_id, rep in reversed(list(STATE.extras.items())):
            if rep is not None:
                rep.restore()
                STATE.extras[extra_id] = None
        # Last applied, first restored: rows that wrap one attribute (the table's order)
        # come off outermost first, so each finds its own wrapper on top.
        for rec in reversed(list(STATE.records.values())):
            kept = [rep.restore() for rep in reversed(rec.replacements)].count("pass-through")
            if rec.replacements:
                rec.set(
                    Code.REVERTED,
                    "unapply() restored the original objects"
                    + (f" ({kept} left as pass-through beneath a later wrapper)" if kept else ""),
                )
                rec.replacements = []
            elif rec.status == ON_IMPORT:
                rec.set(
                    Code.REVERTED,
                    "unapply() was called before the target was imported: it stays "
                    "unpatched in this process unless apply() is called",
                )
        report.write_status_file()


def status() -> dict[str, Any]:
    """The true state of this process (records checked against the live targets)."""
    with LOCK:
        _init_locked()
        install()
        _refresh()
        return views.live()


def _report() -> None:
    report.write_status_file()
    report.log_summary_once()


def _forked_child() -> None:
    """A forked child (vLLM's workers, engine core) logs its own line and runs its own
    in-situ check."""
    STATE.logged = False
    STATE.verify = None


os.register_at_fork(after_in_child=_forked_child)


def _at_exit() -> None:
    try:
        with LOCK:
            report.at_exit()
    except Exception:
        pass
