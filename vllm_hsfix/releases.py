"""Release strings as comparable keys: ``0.24.0+cpu`` or ``0.24.1.dev12+gabc`` -> the
release line ``(0, 24, 0)``. Stdlib only: the scripts use it before anything is installed.
"""

from __future__ import annotations


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
