"""Release strings as comparable keys: the one parser of "0.24.0" in the project.

vLLM versions come as ``0.24.0``, ``0.24.0+cpu``, ``0.24.0+cu128`` or
``0.24.1.dev12+gabc``; what the patch table, the tested-build table, the test rows and
the scripts compare is the release line: the first three numbers. Stdlib only (the
scripts use it before anything is installed); ``plan`` compares full PEP 440 versions
(pre-releases included) with ``packaging`` where that matters.
"""

from __future__ import annotations


def key(release: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of ``release``; a local label and a dev/post suffix are
    ignored, missing parts count as 0. Raises ``ValueError`` on a string with no leading
    number."""
    head = release.strip().split("+", 1)[0]
    nums: list[int] = []
    for part in head.split(".")[:3]:
        digits = ""
        for c in part:
            if not c.isdigit():
                break
            digits += c
        if not digits:
            break
        nums.append(int(digits))
    if not nums:
        raise ValueError(f"not a release: {release!r}")
    while len(nums) < 3:
        nums.append(0)
    return nums[0], nums[1], nums[2]


def in_range(release: str, first: str, fixed_in: str) -> bool:
    """``first <= release < fixed_in``, by release line."""
    return key(first) <= key(release) < key(fixed_in)
