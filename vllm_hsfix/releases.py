"""Release strings compared: ``key`` as a sort key (stdlib only: the scripts use it before
anything is installed), ``reached`` and ``fixed`` as the row ranges' bounds (packaging),
and :data:`LAST_READ`, the newest release whose targets this version has read.
"""

from __future__ import annotations

# The newest vLLM release whose patch targets were read (``tested.json`` holds it): on a
# later one a row with no known upstream fix is decided by its target's code shape.
# Following a new release: ``docs/maintaining.md``.
LAST_READ = "0.33.0"


def key(release: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of ``release``; labels and suffixes are ignored, missing
    parts count as 0. Raises ``ValueError`` on a string with no leading number."""
    nums = []
    for part in release.strip().split("+", 1)[0].split(".")[:3]:
        digits = part[: len(part) - len(part.lstrip("0123456789"))]
        if not digits:
            break
        nums.append(int(digits))
    if not nums:
        raise ValueError(f"not a release: {release!r}")
    major, minor, patch = (*nums, 0, 0)[:3]
    return major, minor, patch


def reached(version: str, first: str) -> bool:
    """Whether ``version``'s X.Y.Z release is ``first`` or later (``0.24.0rc1`` is
    0.24.0's line). Raises ``ValueError`` on an unreadable version."""
    from packaging.version import Version

    return Version(Version(version).base_version) >= Version(first)


def fixed(version: str, fixed_in: str) -> bool:
    """Whether ``version``'s public version is ``fixed_in`` or later (``0.25.0rc1`` is
    below 0.25.0, unlike PEP 440's ``<``). Raises ``ValueError`` on an unreadable one."""
    from packaging.version import Version

    return Version(Version(version).public) >= Version(fixed_in)


def newer_than_read(version: str) -> bool:
    """Whether ``version``'s release line comes after :data:`LAST_READ` (never read)."""
    from packaging.version import Version

    return Version(Version(version).base_version) > Version(LAST_READ)
