"""The one decision function: which patch to apply on the vLLM installed here.

``decide`` is pure: from what detection found (never importing vLLM), the switches,
the patch's declared range and, only when the release is in range, a probe of the
target's code, it returns one :class:`Decision`. The live runtime calls it with a
probe of the imported module; ``vllm-hsfix status`` calls it with a probe of the file
on disk. Same inputs, same answer, same words.

The order of the questions is the order of their authority:

1. no vLLM -> ``no-vllm``;
2. a release at or above the patch's own fixed release -> ``upstream-fix-present``
   (whatever the switches say: there is nothing to turn off);
3. a release below the patch's range -> ``not-needed``;
4. a build of a platform the patch does not concern (``PatchSpec.platform``, e.g.
   the CPU block zeroing on a CUDA wheel) -> ``not-needed``: its target never runs
   there, so it is decided now instead of waiting for an import that never comes;
5. ``VLLM_HSFIX_DISABLE`` / ``VLLM_HSFIX_DISABLED_PATCHES`` -> ``disabled``;
6. an unreadable version -> ``unknown-version`` (refused);
7. the shape gate: fixed code -> ``upstream-fix-present``; an unknown shape ->
   ``unknown-shape`` (refused); a known one -> ``apply``.

Every answer but the last needs no look at the target's code, so the runtime can
decide those patches at activation, before their modules are imported
(:func:`needs_probe`).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from packaging.version import Version

from .codes import Code
from .config import DISABLE, DISABLED_PATCHES, VLLM_VERSION, Config
from .detect import VllmInstall
from .patches import PatchSpec

if TYPE_CHECKING:
    from .shapes import Probe

APPLY = Code.APPLY


@dataclass(frozen=True)
class Decision:
    """What the gates say about one patch: ``Code.APPLY`` or the reason not to."""

    code: Code
    reason: str
    probe: Probe | None = None


_ORDER = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


def _bound_holds(version: Version, op: str, bound: Version) -> bool:
    """One ordered bound. Lower bounds compare the X.Y.Z release only, so a pre-release,
    dev or local build of 0.24.0 (``0.24.0rc1``, ``0.24.1.dev12+gabc``, ``0.24.0+cu128``)
    belongs to the line its release does. Upper bounds compare the full public version
    in plain version order, so a pre-release or dev build of the fixed release
    (``0.25.0rc1``, ``0.25.0.dev3``) is still in range (PEP 440's exclusive ``<V`` would
    drop it): the shape gate then decides from its code whether it has the fix."""
    if op[0] == ">":
        return _ORDER[op](Version(".".join(str(p) for p in version.release)), bound)
    return _ORDER[op](Version(version.public), bound)


def in_row_range(version: Version, patch: PatchSpec) -> bool:
    """Whether ``version`` is in the row's releases, ``first`` up to ``fixed_in``: two
    versions, no specifier to parse at activation in every vLLM process."""
    return _bound_holds(version, ">=", Version(patch.first)) and _bound_holds(
        version, "<", Version(patch.fixed_in)
    )


def in_release_range(version: Version, releases: str) -> bool:
    """Whether ``version`` falls in ``releases``, PEP 440 specifiers parsed by
    ``packaging``; ordered bounds as :func:`_bound_holds` reads them."""
    from packaging.specifiers import SpecifierSet

    return all(
        _bound_holds(version, spec.operator, Version(spec.version))
        if spec.operator in _ORDER
        else spec.contains(Version(version.public), prereleases=True)
        for spec in SpecifierSet(releases)
    )


def is_fixed_release(patch: PatchSpec, version: Version) -> bool:
    """Whether ``version`` carries upstream's fix for ``patch`` (its ``fixed_in``)."""
    return Version(version.public) >= Version(patch.fixed_in)


class _NeedsProbe(Exception):
    """Raised by the probe :func:`needs_probe` hands to :func:`decide`."""


def _no_look() -> Probe:
    raise _NeedsProbe


def without_probe(patch: PatchSpec, install: VllmInstall, cfg: Config) -> Decision | None:
    """The decision when it needs no look at the target's code, else None."""
    try:
        return decide(patch, install, cfg, _no_look)
    except _NeedsProbe:
        return None


def decide(
    patch: PatchSpec, install: VllmInstall, cfg: Config, probe: Callable[[], Probe]
) -> Decision:
    """Run the gates for one patch. ``probe`` is called only when it matters."""
    if not install.present:
        return Decision(Code.NO_VLLM, "vLLM is not installed")
    parsed = install.parsed
    if parsed is not None:
        if is_fixed_release(patch, parsed) and not patch.upstream_fixed:
            return Decision(
                Code.NOT_NEEDED,
                f"vLLM {install.version}: not read by this version of vllm-hsfix (the patch "
                f"covers releases before {patch.fixed_in}, no upstream fix is known); left "
                "alone",
            )
        if is_fixed_release(patch, parsed):
            return Decision(
                Code.UPSTREAM_FIX,
                f"upstream fix present: vLLM {install.version} >= {patch.fixed_in}",
            )
        if not in_row_range(parsed, patch):
            return Decision(Code.NOT_NEEDED, f"vLLM {install.version}: {patch.not_needed}")
    if not patch.runs_on(install.cpu_build):
        return Decision(Code.NOT_NEEDED, patch.other_platforms)
    if cfg.disabled or patch.id in cfg.disabled_patches:
        switch = f"{DISABLE}=1" if cfg.disabled else f"{DISABLED_PATCHES} names {patch.id}"
        return Decision(Code.DISABLED, f"turned off by {switch}")
    if parsed is None:
        return Decision(
            Code.UNKNOWN_VERSION,
            (install.problem or "vLLM version unknown")
            + f"; not patching (set {VLLM_VERSION} to the release it is)",
        )
    result = probe()
    if result.fixed:
        return Decision(
            Code.UPSTREAM_FIX,
            f"upstream fix present: vLLM {install.version} code is fixed ({result.detail})",
            result,
        )
    if result.shape is None:
        return Decision(
            Code.UNKNOWN_SHAPE,
            f"vLLM {install.version}: {patch.target} does not look like any known shape; "
            f"not patched ({result.detail})",
            result,
        )
    return Decision(APPLY, f"vLLM {install.version}: shape {result.shape}", result)


def target_file(patch: PatchSpec, install: VllmInstall) -> str:
    """The source file of ``patch``'s target module in the installed vLLM (not imported)."""
    root = os.path.dirname(install.location or "")
    return os.path.join(root, *patch.module.split(".")[1:]) + ".py"


def decide_from_file(patch: PatchSpec, install: VllmInstall, cfg: Config) -> Decision:
    """:func:`decide` with the shape gate run on the target's file on disk: what
    ``vllm-hsfix status`` reports, and what the runtime announces at activation for a
    target not imported yet (the live module is probed again when it is)."""
    from .shapes import probe_file

    impl = patch.implementation()
    path = target_file(patch, install)
    return decide(patch, install, cfg, lambda: probe_file(path, impl.probe_tree))
