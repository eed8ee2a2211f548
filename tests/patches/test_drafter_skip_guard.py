"""``drafter-skip-guard`` (0.25-0.28, vLLM PR 53962): the hit lengths it does not use,
worked out by hand, and the release's own KV cache manager with the wrapper on and off.
The engine run that fails first and then writes right files: test_hazards_e2e.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_hsfix.patches._wrap import original_of
from vllm_hsfix.patches.drafter_skip_guard import fix

PATCH = "drafter-skip-guard"


# By hand: n speculative tokens pad a one-token remainder to 1 + n when m + 1 + n <= L;
# the drafter then needs m + 1 + n + n <= L. n = 1: only m = L - 2; n = 2: L - 4, L - 3.
@pytest.mark.parametrize(
    ("max_len", "n", "hits"),
    [(66, 1, [64]), (65, 1, [63]), (4098, 1, [4096]), (68, 2, [64, 65]), (7, 3, [1, 2, 3]),
     (3, 1, [1]), (2, 1, [])],
)  # fmt: skip
def test_skip_lengths(max_len: int, n: int, hits: list[int]) -> None:
    assert list(fix.skip_lengths(max_len, n)) == hits


def manager(hit: int) -> tuple[object, object]:
    """A bare instance of the installed release's KVCacheManager whose prefix cache
    finds ``hit`` tokens (its coordinator is the only part set by hand), and its empty
    blocks; max_model_len 66 and one speculative token, as the scheduler sets them."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    mgr = KVCacheManager.__new__(KVCacheManager)
    empty = object()
    mgr.__dict__.update(
        enable_caching=True, log_stats=False, empty_kv_cache_blocks=empty,
        coordinator=SimpleNamespace(find_longest_cache_hit=lambda hashes, most: (["b"], hit)),
        create_kv_cache_blocks=lambda blocks: blocks,
    )  # fmt: skip
    mgr.__dict__[fix.LENGTHS] = fix.skip_lengths(66, 1)
    return mgr, empty


def request(tokens: int) -> SimpleNamespace:
    return SimpleNamespace(
        num_tokens=tokens, skip_reading_prefix_cache=False, block_hashes=[], num_preemptions=0
    )


@pytest.mark.needs_vllm
@pytest.mark.applies(PATCH)
def test_the_release_uses_the_hit_and_the_patched_manager_does_not() -> None:
    """Fails first: the release's own method returns the hit of 64 for a 65-token prompt
    (the one the scheduler pads to 66); patched, no hit, and any other prompt keeps it."""
    import vllm_hsfix

    vllm_hsfix.apply()
    import vllm.v1.core.sched.scheduler  # noqa: F401  (the row's module: patched on import)
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    assert vllm_hsfix.status()["patches"][PATCH]["status"] == "applied"
    live = KVCacheManager.get_computed_blocks
    mgr, empty = manager(64)
    release = original_of(KVCacheManager.__dict__["get_computed_blocks"])
    assert release is not KVCacheManager.__dict__["get_computed_blocks"], "not wrapped"
    assert release(mgr, request(65)) == (["b"], 64)  # the release alone
    assert live(mgr, request(65)) == (empty, 0)
    assert live(mgr, request(66)) == (["b"], 64)
    mgr, _ = manager(48)
    assert live(mgr, request(49)) == (["b"], 48)
