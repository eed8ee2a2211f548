"""One status model: each patch row's entry, the static view (``vllm-hsfix status``,
read from files, vLLM not imported) and the live one (this process, ``vllm_hsfix.status()``
and status files), and the one policy over both (exit codes, ``verify``, strict mode).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from . import _lazy
from ._version import __version__
from .codes import IN_PLACE, NOTHING_TO_DO, Code
from .state import STATE

# Codes under which a row is fine here: in place (or will be), not needed, not decided
# yet, or taken back by the program's own ``unapply()``.
FINE = IN_PLACE | NOTHING_TO_DO | {Code.WAITING, Code.REVERTED, Code.NO_VLLM}
REQUIREMENTS = ("applied", "fixed", "tested")
ENTRY_POINT = "vllm_hsfix"


def entry(
    patch: Any, code: str, reason: str, shape: str | None, prints: Mapping[str, str]
) -> dict[str, Any]:
    """A row's entry in either view: what was decided or happened, and the row itself."""
    return {
        "status": Code(code).status,
        "code": Code(code).value,
        "reason": reason,
        "target": patch.target,
        "releases": patch.releases,
        "platform": patch.platform,
        "optional": patch.optional,
        "upstream": patch.upstream,
        "why": patch.why,
        "shape": shape,
        "fingerprints": dict(prints),
    }


def not_in_place(patches: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The one policy of ``status``, ``verify`` and strict mode: of the entries, those
    whose fix cannot apply here, as ``"id: code: reason"``. A row the release needs that
    is disabled, refused, failed or overwritten counts; an optional row (beyond upstream:
    no data is wrong without it) may be turned off. No vLLM is each caller's own answer."""
    return [
        f"{pid}: {Code(p['code'])}: {p['reason']}"
        for pid, p in patches.items()
        if Code(p["code"]) not in FINE and not (Code(p["code"]) == Code.DISABLED and p["optional"])
    ]


def records_not_in_place() -> list[str]:
    """:func:`not_in_place` of this process's records (strict mode, ``verify``)."""
    return not_in_place(records())


def records() -> dict[str, dict[str, Any]]:
    """This process's records as entries."""
    return {
        p: entry(r.patch, r.code, r.reason, r.shape, r.fingerprints)
        for p, r in STATE.records.items()
    }


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


def live() -> dict[str, Any]:
    """This process's view: its records, as the runtime holds them."""
    from . import tested  # reads tested.json: not at activation

    cfg, inst = STATE.config, STATE.install
    assert cfg is not None and inst is not None
    patches = records()
    problems = not_in_place(patches)
    effect = STATE.extras.get("provenance")
    return {
        "vllm_hsfix": __version__,
        "pid": os.getpid(),
        "role": process_role(),
        "activated_by": _lazy.sources(),
        "enabled": STATE.enabled,
        "unapplied": STATE.unapplied,
        "vllm": inst.as_dict(),
        "tested_build": tested.describe(inst, {p: e["fingerprints"] for p, e in patches.items()}),
        "config": cfg.as_dict(),
        "patches": patches,
        "verify": STATE.verify,
        "provenance": effect is not None and effect.in_effect(),
        "errors": list(STATE.errors) + _lazy.errors(),
        "ok": not problems,
        "problems": problems,
    }


def entry_point() -> dict[str, Any]:
    """vLLM's plugin entry point for vllm-hsfix here, and whether VLLM_PLUGINS keeps it."""
    from importlib import metadata

    eps = [
        ep for ep in metadata.entry_points(group="vllm.general_plugins") if ep.name == ENTRY_POINT
    ]
    allowed = os.environ.get("VLLM_PLUGINS")
    filtered = allowed is not None and ENTRY_POINT not in [n.strip() for n in allowed.split(",")]
    return {
        "registered": bool(eps),
        "value": eps[0].value if eps else None,
        "vllm_plugins": allowed,
        "filtered_out_by_VLLM_PLUGINS": filtered,
    }


def static(bootstrap: Any) -> dict[str, Any]:
    """What activation would do here, from metadata and source files (vLLM is not
    imported), decided by ``plan.decide`` as the runtime decides."""
    from . import backends, config, detect, hazards, plan, releases, tested
    from .patches import PATCH_IDS, PATCHES

    cfg = config.load(known_patches=PATCH_IDS)
    inst = detect.detect(cfg.vllm_version_override)
    patches: dict[str, Any] = {}
    by_shape: list[str] = []  # past the last release read, decided by the code alone
    for patch in PATCHES:
        decision = plan.decide_from_file(patch, inst, cfg)
        probe = decision.probe
        if probe is not None and plan.by_shape(patch, inst.version or ""):
            by_shape.append(patch.id)
        shape, prints = (probe.shape, probe.fingerprints) if probe else (None, {})
        patches[patch.id] = entry(patch, decision.code, decision.reason, shape, prints)
    codes = {pid: p["code"] for pid, p in patches.items()}
    newer = bool(inst.version) and releases.newer_than_read(inst.version or "")
    return {
        "vllm_hsfix": __version__,
        "vllm": inst.as_dict(),
        "tested_build": tested.describe(inst, {p: e["fingerprints"] for p, e in patches.items()}),
        "patches": patches,
        "releases_read": {"last": releases.LAST_READ, "newer": newer, "by_shape": by_shape},
        "hazards": hazards.assess_all(inst.release, codes, inst.cpu_build, hazards.cpu_has_amx()),
        "hs_connectors": backends.describe(codes),
        "activation": {
            "entry_point": entry_point(),
            "bootstrap_dir": str(bootstrap),
            "bootstrap_usable": (bootstrap / "sitecustomize.py").is_file(),
        },
        "config": cfg.as_dict(),
    }


def exit_code(view: dict[str, Any], require: tuple[str, ...] = ()) -> tuple[int, list[str]]:
    """(exit code, problems) of the static view: 2 no vLLM, 1 a problem, else 0."""
    if not view["vllm"]["present"]:
        return 2, ["no vLLM is importable by this interpreter (is this the image's Python?)"]
    problems = not_in_place(view["patches"])
    codes = {p["code"] for p in view["patches"].values()}
    ep = view["activation"]["entry_point"]
    affected = Code.APPLY in codes
    if affected and not ep["registered"]:
        problems.append("the vllm.general_plugins entry point is not registered here")
    if affected and ep["filtered_out_by_VLLM_PLUGINS"]:
        problems.append(f"VLLM_PLUGINS={ep['vllm_plugins']!r} leaves out {ENTRY_POINT}")
    if "applied" in require and not affected:
        problems.append("--require applied: vllm-hsfix has nothing to patch on this vLLM")
    if "fixed" in require:
        fixed = (Code.NOT_NEEDED, Code.UPSTREAM_FIX)
        unfixed = [pid for pid, p in view["patches"].items() if p["code"] not in fixed]
        unfixed += [pid for pid in view["releases_read"]["by_shape"] if pid not in unfixed]
        if unfixed:
            problems.append(
                "--require fixed: this vLLM does not carry the upstream fix of "
                + ", ".join(unfixed)
            )
    if "tested" in require and not view["tested_build"]["tested"]:
        problems.append(f"--require tested: {view['tested_build']['reason']}")
    return (1 if problems else 0), problems
