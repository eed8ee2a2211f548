"""The one decision function: which patch to apply on the vLLM installed here.

``decide`` is pure; its gates, in order (``release_gate``): detection failed; no vLLM;
fixed release; below range; other platform; switched off; unreadable version; then the
shape gate (only then probed), which alone decides a row with no known upstream fix.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from .codes import Code
from .config import DISABLE, DISABLED_PATCHES, VLLM_VERSION, Config
from .detect import VllmInstall
from .patches import PatchSpec
from .releases import LAST_READ, fixed, newer_than_read, reached

if TYPE_CHECKING:
    from .shapes import Probe


class Decision(NamedTuple):
    """What the gates say about one patch: ``Code.APPLY`` or the reason not to."""

    code: Code
    reason: str
    probe: Probe | None = None


def release_gate(patch: PatchSpec, install: VllmInstall, cfg: Config) -> Decision | None:
    """The decision when it needs no look at the target's code, else None (the gates
    before the shape gate; the tests' and scripts' oracles call it too)."""
    if install.source == "error":  # detection itself failed (the runtime's record of it)
        return Decision(Code.ERROR, install.problem or "vLLM detection failed")
    if not install.present:
        return Decision(Code.NO_VLLM, "vLLM is not installed")
    version = install.version
    if version is not None and patch.fixed_in and fixed(version, patch.fixed_in):
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
    return None


def by_shape(patch: PatchSpec, version: str) -> bool:
    """Whether ``version`` is past every release read and the row has no known upstream
    fix: its code shape alone decides (``status`` names these rows)."""
    return patch.fixed_in is None and newer_than_read(version)


def decide(
    patch: PatchSpec, install: VllmInstall, cfg: Config, probe: Callable[[], Probe]
) -> Decision:
    """Run the gates for one patch. ``probe`` is called only when it matters."""
    gated = release_gate(patch, install, cfg)
    if gated is not None:
        return gated
    version = install.version
    assert version is not None  # release_gate decided every build of unknown version
    result = probe()
    vllm, detail = f"vLLM {version}", ""
    if by_shape(patch, version):
        vllm += f" (newer than {LAST_READ}, the last release read: decided by code shape)"
        detail = f" ({result.detail})"
    if result.fixed:
        fix = "upstream fix present: " if patch.fixed_in else "its code no longer has the bug: "
        return Decision(Code.UPSTREAM_FIX, f"{fix}{vllm} ({result.detail})", result)
    if result.shape is None:
        return Decision(
            Code.UNKNOWN_SHAPE,
            f"{vllm}: {patch.target} does not look like any known shape; "
            f"not patched ({result.detail})",
            result,
        )
    return Decision(Code.APPLY, f"{vllm}: shape {result.shape}{detail}", result)


def decide_from_file(patch: PatchSpec, install: VllmInstall, cfg: Config) -> Decision:
    """:func:`decide` with the shape gate run on the target's file on disk."""
    from .shapes import probe_file

    impl = patch.implementation()
    root = os.path.dirname(install.location or "")
    path = os.path.join(root, *patch.module.split(".")[1:]) + ".py"
    return decide(patch, install, cfg, lambda: probe_file(path, impl.probe_tree))
