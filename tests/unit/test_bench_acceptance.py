"""``benchmarks/bench_acceptance.py``'s verdict and language, without running it (the
benchmark itself is not in CI: docs/benchmarks.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_acceptance
from acceptance import language


def figures(off: float, fixed: float, ref: float) -> dict[str, dict[str, float]]:
    return {"fixes-off": {"acceptance": off}, "vllm-hsfix": {"acceptance": fixed},
            "reference": {"acceptance": ref}}  # fmt: skip


@pytest.mark.parametrize(
    ("off", "fixed", "ref", "code"),
    [
        (0.23, 1.0, 1.0, 0),  # measured
        (0.0, 0.9, 1.0, 0),
        (0.4, 1.0, 1.0, 1),  # fixes-off not below a third of the reference
        (0.0, 0.2, 0.25, 1),  # the reference draft itself accepts too little
        (0.0, 0.5, 1.0, 1),  # vllm-hsfix's draft falls short of the reference's
    ],
)
def test_the_verdict_needs_the_contrast(off: float, fixed: float, ref: float, code: int) -> None:
    assert bench_acceptance.verdict(figures(off, fixed, ref))[0] == code


def test_the_language_needs_the_context_not_the_last_token() -> None:
    """Most tokens go to a different next token in each mode: the last token alone does
    not tell the next one; the same seed gives the same prompts in every environment."""
    ambiguous = sum(len({p[x] for p in language.PERM}) > 1 for x in range(language.ALPHABET))
    assert ambiguous > 0.9 * language.ALPHABET
    assert language.prompts(1, 4, 48, 128) == language.prompts(1, 4, 48, 128)
    assert all(language.FIRST <= t < language.FIRST + language.ALPHABET
               for p in language.prompts(1, 4, 48, 128) for t in p)  # fmt: skip
