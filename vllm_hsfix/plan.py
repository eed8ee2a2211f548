"""The one decision function: which patch to apply on the vLLM installed here.

``decide`` is pure; its gates, in order: detection failed; no vLLM; fixed release; below
range; other platform; switched off; unreadable version; then the shape gate (only then
probed).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from .codes import Code
from .config import DISABLE, DISABLED_PATCHES, VLLM_VERSION, Config
from .detect import VllmInstall
from .patches import PatchSpec
from .releases import fixed, reached

if TYPE_CHECKING:
    from .shapes import Probe


class Decision(NamedTuple):
    """What the gates say about one patch: ``Code.APPLY`` or the reason not to."""

    code: Code
    reason: str
    probe: Probe | None = None


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
    if install.source == "error":  # detection itself failed (the runtime's record of it)
        return Decision(Code.ERROR, install.problem or "vLLM detection failed")
    if not install.present:
        return Decision(Code.NO_VLLM, "vLLM is not installed")
    version = install.version
    if version is not None and fixed(version, patch.fixed_in):
        if not patch.upstream_fixed:
            return Decision(
                Code.NOT_NEEDED,
                f"vLLM {version}: not read by this version of vllm-hsfix (the patch "
                f"covers releases before {patch.fixed_in}, no upstream fix is known); left "
                "alone",
            )
        return Decision(
            Code.UPSTREAM_FIX, f"upstream fix present: vLLM {version} >= {patch.fixed_in}"
        )
    if version is not None and not reached(version, patch.first):
        return Decision(Code.NOT_NEEDED, f"vLLM {version}: {patch.not_needed}")
    if not patch.runs_on(install.cpu_build):
        return Decision(Code.NOT_NEEDED, patch.other_platforms)
    if cfg.disabled or patch.id in cfg.disabled_patches:
        switch = f"{DISABLE}=1" if cfg.disabled else f"{DISABLED_PATCHES} names {patch.id}"
        return Decision(Code.DISABLED, f"turned off by {switch}")
    if version is None:
        return Decision(
            Code.UNKNOWN_VERSION,
            (install.problem or "vLLM version unknown")
            + f"; not patching (set {VLLM_VERSION} to the release it is)",
        )
    result = probe()
    if result.fixed:
        return Decision(
            Code.UPSTREAM_FIX,
            f"upstream fix present: vLLM {version} code is fixed ({result.detail})",
            result,
        )
    if result.shape is None:
        return Decision(
            Code.UNKNOWN_SHAPE,
            f"vLLM {version}: {patch.target} does not look like any known shape; "
            f"not patched ({result.detail})",
            result,
        )
    return Decision(Code.APPLY, f"vLLM {version}: shape {result.shape}", result)


def decide_from_file(patch: PatchSpec, install: VllmInstall, cfg: Config) -> Decision:
    """:func:`decide` with the shape gate run on the target's file on disk."""
    from .shapes import probe_file

    impl = patch.implementation()
    root = os.path.dirname(install.location or "")
    path = os.path.join(root, *patch.module.split(".")[1:]) + ".py"
    return decide(patch, install, cfg, lambda: probe_file(path, impl.probe_tree))
