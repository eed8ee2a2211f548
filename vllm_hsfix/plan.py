"""The one decision function: which patch to apply on the vLLM installed here.

``decide`` is pure: from what detection found (never importing vLLM), the switches,
the patch's declared range and, only when the release is in range, a probe of the
target's code, it returns one :class:`Decision`. The live runtime calls it with a
probe of the imported module; ``vllm-hsfix status`` calls it with a probe of the file
on disk. Same inputs, same answer, same words.

The order of the questions is the order of their authority:

1. no vLLM -> ``no-vllm``;
2. a release at or above the fixed one -> ``upstream-fix-present`` (whatever the
   switches say: there is nothing to turn off);
3. a release outside the patch's range -> ``not-needed``;
4. ``VLLM_HSFIX_DISABLE`` / ``VLLM_HSFIX_DISABLED_PATCHES`` -> ``disabled``;
5. an unreadable version -> ``unknown-version`` (refused);
6. the shape gate: fixed code -> ``upstream-fix-present``; an unknown shape ->
   ``unknown-shape`` (refused); a known one -> ``apply``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .config import DISABLE, DISABLED_PATCHES, VLLM_VERSION, Config
from .detect import VllmInstall
from .patches import FIXED_FROM, PatchSpec
from .shapes import Probe

APPLY = "apply"


@dataclass(frozen=True)
class Decision:
    """What the gates say about one patch: ``code`` as in ``state.CODES`` or "apply"."""

    code: str
    reason: str
    probe: Probe | None = None


def in_release_range(version: Version, releases: str) -> bool:
    """Whether ``version`` falls in ``releases``.

    Lower bounds compare the X.Y.Z release only, so a pre-release, dev or local build
    of 0.24.0 (``0.24.0rc1``, ``0.24.1.dev12+gabc``, ``0.24.0+cu128``) belongs to the
    line its release does. Upper bounds compare the full public version, so a dev
    build of the fixed release (``0.25.0.dev3``) is still in range: the shape gate
    then decides from its code whether it already has the fix.
    """
    public = Version(version.public)
    release = Version(".".join(str(p) for p in version.release))
    for spec in SpecifierSet(releases):
        bound = Version(spec.version)
        op = spec.operator
        if op == ">=":
            ok = release >= bound
        elif op == ">":
            ok = release > bound
        elif op == "<":
            ok = public < bound
        elif op == "<=":
            ok = public <= bound
        else:
            ok = spec.contains(public, prereleases=True)
        if not ok:
            return False
    return True


def is_fixed_release(version: Version) -> bool:
    return Version(version.public) >= Version(FIXED_FROM)


def decide(
    patch: PatchSpec, install: VllmInstall, cfg: Config, probe: Callable[[], Probe]
) -> Decision:
    """Run the gates for one patch. ``probe`` is called only when it matters."""
    if not install.present:
        return Decision("no-vllm", "vLLM is not installed")
    parsed = install.parsed
    if parsed is not None:
        if is_fixed_release(parsed):
            return Decision(
                "upstream-fix-present",
                f"upstream fix present: vLLM {install.version} >= {FIXED_FROM}",
            )
        if not in_release_range(parsed, patch.releases):
            return Decision("not-needed", f"vLLM {install.version}: {patch.not_needed}")
    if cfg.disabled or patch.id in cfg.disabled_patches:
        switch = f"{DISABLE}=1" if cfg.disabled else f"{DISABLED_PATCHES} names {patch.id}"
        return Decision("disabled", f"turned off by {switch}")
    if parsed is None:
        return Decision(
            "unknown-version",
            (install.problem or "vLLM version unknown")
            + f"; not patching (set {VLLM_VERSION} to the release it is)",
        )
    result = probe()
    if result.fixed:
        return Decision(
            "upstream-fix-present",
            f"upstream fix present: vLLM {install.version} code is fixed ({result.detail})",
            result,
        )
    if result.shape is None:
        return Decision(
            "unknown-shape",
            f"vLLM {install.version}: {patch.target} does not look like any known shape; "
            f"not patched ({result.detail})",
            result,
        )
    return Decision(APPLY, f"vLLM {install.version}: shape {result.shape}", result)
