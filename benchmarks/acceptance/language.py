"""A synthetic language a tiny verifier learns in minutes and a draft can imitate.

Each sequence has a hidden mode ``z`` (one of ``MODES``), fixed for the sequence; the
next token is ``PERM[z][x]`` of the current one, except that a prompt's tokens are
replaced by a random token with probability ``NOISE``. The last token alone does not
tell the next (every mode maps it elsewhere): the mode has to be read from the
context, which the verifier's hidden states carry and a draft can read from them.
Pure Python (``random``), so every environment draws the same prompts.
"""

from __future__ import annotations

import random

FIRST = 4  # token ids FIRST .. FIRST + ALPHABET - 1 (below the tiny models' special ids)
ALPHABET = 64
MODES = 4
NOISE = 0.15
SEED = 1234


def permutations(seed: int = SEED) -> list[list[int]]:
    """One random permutation of the alphabet per mode."""
    rng = random.Random(seed)
    perms = []
    for _ in range(MODES):
        p = list(range(ALPHABET))
        rng.shuffle(p)
        perms.append(p)
    return perms


PERM = permutations()


def sequence(rng: random.Random, length: int, noise: float = NOISE) -> list[int]:
    """One sequence of ``length`` token ids in a random mode."""
    z = rng.randrange(MODES)
    x = rng.randrange(ALPHABET)
    out = [x]
    for _ in range(length - 1):
        x = PERM[z][x]
        out.append(rng.randrange(ALPHABET) if rng.random() < noise else x)
        x = out[-1]
    return [FIRST + t for t in out]


def prompts(seed: int, count: int, low: int, high: int) -> list[list[int]]:
    """``count`` sequences of ``low`` .. ``high`` tokens (seed 0: the verifier's own
    training data; other seeds: extraction prompts and held-out prompts)."""
    rng = random.Random(seed)
    return [sequence(rng, rng.randint(low, high)) for _ in range(count)]
