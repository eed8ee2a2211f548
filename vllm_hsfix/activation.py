"""One idempotent activation: detect vLLM, gate each patch, wrap, record, log once.

Every path in (``import vllm_hsfix``, the vLLM plugin, the sitecustomize bootstrap,
``apply()``) ends in :func:`start`. Patching happens in post-import hooks on the
target modules (wrapt's), so it is right whether vLLM was imported before or after
activation. Failures are recorded and logged, never raised, unless strict mode is on.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from . import __version__, _lazy, config, detect, gate
from .patches import FIXED_FROM, MODULES, PATCH_IDS, PATCHES
from .state import APPLIED, FAILED, LOCK, PENDING, REFUSED, SKIPPED, STATE, Record

log = logging.getLogger("vllm_hsfix")


class HsfixError(RuntimeError):
    """Raised only in strict mode, when the fix cannot be put in place."""


class _CurrentStderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at emit time: the line logged at exit must
    not hit a stream that was swapped and closed since set-up (pytest's capture, a
    daemon redirecting its output)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def _setup_logging(cfg: config.Config) -> None:
    log.setLevel(cfg.log_level)
    if not any(getattr(h, "_vllm_hsfix", False) for h in log.handlers):
        handler = _CurrentStderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s [vllm-hsfix] %(message)s"))
        handler._vllm_hsfix = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    # Our own handler, so the per-process line is seen whatever vLLM does to its loggers.
    log.propagate = False


def _init_locked() -> config.Config:
    if STATE.config is None:
        cfg = config.load(known_patches=PATCH_IDS)
        STATE.config = cfg
        _setup_logging(cfg)
        STATE.records = {p.id: Record(p) for p in PATCHES}
        for w in cfg.warnings:
            log.warning(w)
        atexit.register(_report_at_exit)
    return STATE.config


def install() -> detect.VllmInstall:
    with LOCK:
        cfg = _init_locked()
        if STATE.install is None:
            try:
                STATE.install = detect.detect(cfg.vllm_version_override)
            except Exception as exc:
                STATE.install = detect.VllmInstall(
                    present=False, source="error", problem=f"vLLM detection failed: {exc!r}"
                )
                _internal_error(STATE.install.problem or "", exc)
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
    """Entry point of every activation path. Idempotent and thread-safe."""
    try:
        with LOCK:
            cfg = _init_locked()
            if source not in _lazy._SOURCES:
                _lazy._SOURCES.append(source)
            if cfg.disabled:
                for rec in STATE.records.values():
                    rec.set("disabled", f"{config.DISABLE}=1")
                _report()
                return
            first = not STATE.enabled and not STATE.hooks_registered
            STATE.enabled = True
            if first:
                _plugins_warning()
            _register_hooks()
            # Modules imported before (or reverted by unapply): decide now.
            for name in MODULES:
                module = sys.modules.get(name)
                if module is not None:
                    _on_import(module)
    except HsfixError:
        raise
    except Exception as exc:  # never into the user's program
        _internal_error(f"activation from {source} failed: {exc!r}", exc)


def _internal_error(message: str, exc: BaseException | None = None) -> None:
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
    import wrapt

    for name in MODULES:
        wrapt.register_post_import_hook(_on_import, name)
    STATE.hooks_registered = True


def _on_import(module: ModuleType) -> None:
    with LOCK:
        if not STATE.enabled:
            return
        for rec in STATE.records.values():
            if rec.patch.module == module.__name__ and rec.status in (PENDING, "reverted"):
                _decide(rec, module)
        _maybe_observe()
        _maybe_provenance()
        _report()
        cfg = STATE.config
        if cfg is not None and cfg.strict:
            bad = [r for r in STATE.records.values() if r.status in (REFUSED, FAILED)]
            if bad:
                raise HsfixError(
                    "strict mode: " + "; ".join(f"{r.patch.id} {r.status}: {r.reason}" for r in bad)
                )


def _decide(rec: Record, module: ModuleType) -> None:
    cfg = STATE.config
    assert cfg is not None
    patch = rec.patch
    try:
        inst = install()
        if inst.source == "error":
            rec.set("error", inst.problem or "vLLM detection failed")
            return
        impl = patch.implementation()
        decision = gate.decide(
            patch,
            inst.version,
            inst.problem,
            patch.id in cfg.disabled_patches,
            lambda: impl.probe(module),
            FIXED_FROM,
        )
        if decision.probe is not None:
            rec.shape = decision.probe.shape
            rec.fingerprints = dict(decision.probe.fingerprints)
        if decision.code == "apply":
            rec.replacements = impl.apply(module)
            rec.set("applied", decision.reason)
        else:
            rec.set(decision.code, decision.reason)
            if rec.status == REFUSED:
                log.warning("%s refused: %s", patch.id, rec.reason)
    except Exception as exc:
        rec.set("error", f"{type(exc).__name__}: {exc}")
        log.error("%s failed: %s", patch.id, rec.reason, exc_info=log.isEnabledFor(logging.DEBUG))


def _maybe_observe() -> None:
    """Where only the clamp applies, hook the in-situ check onto register_kv_caches."""
    scatter = STATE.records["scatter-clamp"]
    conn = STATE.records["hidden-group-block-size"]
    cfg = STATE.config
    module = sys.modules.get(conn.patch.module)
    if (
        module is None
        or cfg is None
        or not cfg.verify
        or scatter.status != APPLIED
        or conn.status != SKIPPED  # decided, and not wrapping register_kv_caches itself
    ):
        return
    try:
        from .patches import connector

        rep = connector.observe(module)
        if rep is not None:
            scatter.replacements.append(rep)
    except Exception as exc:
        log.warning("in-situ check not hooked: %r", exc)


def _maybe_provenance() -> None:
    """With VLLM_HSFIX_PROVENANCE=1 and a patch applied, stamp the files the connector saves."""
    cfg = STATE.config
    conn = STATE.records["hidden-group-block-size"]
    module = sys.modules.get(conn.patch.module)
    applied = [r for r in STATE.records.values() if r.status == APPLIED]
    if module is None or cfg is None or not cfg.provenance or not applied:
        return
    try:
        from . import provenance

        rep = provenance.install(module)
        if rep is not None:
            applied[-1].replacements.append(rep)
            STATE.provenance = True
    except Exception as exc:
        log.warning("provenance metadata not hooked: %r", exc)


def runtime_failure(patch_id: str, exc: BaseException) -> None:
    """A wrapper hit an unexpected error at run time: record it (raise only if strict)."""
    with LOCK:
        rec = STATE.records.get(patch_id)
        if rec is not None:
            rec.set("error", f"at run time: {type(exc).__name__}: {exc}")
        _write_status_file()
    _internal_error(f"{patch_id} failed at run time: {exc!r}", exc)


def unapply() -> None:
    """Restore every original object exactly and stop patching in this process."""
    with LOCK:
        _init_locked()
        STATE.enabled = False
        for rec in STATE.records.values():
            for rep in reversed(rec.replacements):
                rep.restore()
            if rec.replacements:
                rec.replacements = []
                rec.set("reverted", "unapply() restored the original objects")
        _write_status_file()


def process_role() -> str:
    """Which vLLM process this is, from the names vLLM gives its processes."""
    import multiprocessing

    name = multiprocessing.current_process().name
    if name.startswith("EngineCore"):
        return "engine-core"
    if name.startswith("VllmWorker"):
        return "worker-" + name.rsplit("-", 1)[-1]
    if name == "MainProcess":
        return "main"
    return name


def status() -> dict[str, Any]:
    with LOCK:
        cfg = _init_locked()
        inst = install()
        from . import tested

        return {
            "vllm_hsfix": __version__,
            "pid": os.getpid(),
            "role": process_role(),
            "activated_by": _lazy.sources(),
            "enabled": STATE.enabled,
            "vllm": inst.as_dict(),
            "tested_build": tested.describe(inst, STATE.records),
            "config": {
                "disabled": cfg.disabled,
                "disabled_patches": sorted(cfg.disabled_patches),
                "strict": cfg.strict,
                "verify": cfg.verify,
                "provenance": cfg.provenance,
                "vllm_version_override": cfg.vllm_version_override,
                "warnings": list(cfg.warnings),
            },
            "patches": {pid: rec.as_dict() for pid, rec in STATE.records.items()},
            "verify": STATE.verify,
            "provenance": STATE.provenance,
            "errors": list(STATE.errors),
        }


def summary_line() -> str:
    inst = STATE.install
    vllm = "absent"
    if inst is not None and inst.present:
        vllm = f"{inst.version or inst.raw_version or '?'} ({inst.distribution or inst.source})"
    groups: dict[str, list[str]] = {}
    for rec in STATE.records.values():
        groups.setdefault(rec.status, []).append(
            rec.patch.id if rec.status == APPLIED else f"{rec.patch.id} [{rec.code}]"
        )
    parts = [f"{k} {', '.join(v)}" for k, v in groups.items()]
    line = (
        f"vllm-hsfix {__version__} pid={os.getpid()} role={process_role()} vllm={vllm}: "
        + "; ".join(parts)
    )
    if STATE.verify is not None:
        line += f"; in-situ check {'passed' if STATE.verify.get('ok') else 'FAILED'}"
    return line


def _report() -> None:
    """Log the per-process line once every patch is decided."""
    _write_status_file()
    if STATE.logged or any(r.status == PENDING for r in STATE.records.values()):
        return
    STATE.logged = True
    bad = any(r.status in (REFUSED, FAILED) for r in STATE.records.values())
    log.log(logging.WARNING if bad else logging.INFO, summary_line())


def _report_at_exit() -> None:
    try:
        with LOCK:
            decided = any(r.status != PENDING for r in STATE.records.values())
            if not STATE.logged and decided:
                STATE.logged = True
                log.info(summary_line())
            _write_status_file()
    except Exception:
        pass


def _write_status_file() -> None:
    cfg = STATE.config
    if cfg is None or not cfg.status_dir:
        return
    try:
        path = Path(cfg.status_dir)
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / f".{os.getpid()}.json.tmp"
        tmp.write_text(json.dumps(status(), indent=2, default=str))
        tmp.replace(path / f"{os.getpid()}.json")
    except Exception as exc:
        log.debug("could not write status file: %r", exc)
