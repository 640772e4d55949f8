"""The online block lifecycle (the kv_block_* histograms of the library and the vLLM
scheduler): exact on tiers up to LIFECYCLE_TRACKED blocks, a uniform sample beyond, so
that what it keeps follows a bound, not the tier's size."""

from __future__ import annotations

import hashlib
import random

import pytest

from kvstrata.core.metrics import LIFECYCLE_TRACKED, Histogram, Lifecycle, lifecycle_sampling


def keys(n: int, seed: int = 0) -> list[bytes]:
    return [hashlib.sha256(f"{seed}/{i}".encode()).digest() for i in range(n)]


@pytest.mark.parametrize("capacity, every", [
    (0, 1), (LIFECYCLE_TRACKED, 1), (LIFECYCLE_TRACKED + 1, 2), (4 * LIFECYCLE_TRACKED, 4),
    (4 * LIFECYCLE_TRACKED + 1, 8), (100_000_000, 512),
])
def test_sampling_keeps_the_followed_blocks_at_or_below_the_bound(capacity: int, every: int) -> None:
    assert lifecycle_sampling(capacity) == every
    assert capacity / every <= LIFECYCLE_TRACKED


def test_a_sampled_lifecycle_follows_one_block_in_n_and_weighs_it_n_times() -> None:
    """64k blocks enter, are reused after 3 s and leave 10 s after entering; 1 in 8 followed."""
    every, n = 8, 1 << 16
    lc = Lifecycle(sample_every=every)
    ks = keys(n)
    lc.enter_many(ks, 0.0)
    followed = len(lc._born)
    assert abs(followed - n / every) < 0.1 * n / every  # ~8,192 of 65,536 (hash-chosen)
    lc.access_many(ks, 3.0)
    lc.leave_many(ks, 10.0)
    assert not lc._born and not lc._last
    for h, value in ((lc.lifetime, 10.0), (lc.idle_before_evict, 7.0), (lc.reuse_gap, 3.0)):
        assert h.count == followed * every and h.total() == pytest.approx(value * followed * every)
        assert abs(h.count - n) < 0.1 * n
        assert h.buckets()[-1] == ("+Inf", h.count)


def test_an_unsampled_lifecycle_is_exact() -> None:
    lc = Lifecycle(keep_samples=True)
    ks = keys(1000, seed=1)
    rng = random.Random(0)
    born = {k: rng.uniform(0, 100) for k in ks}
    for k in ks:
        lc.enter(k, born[k])
    for k in ks:
        lc.leave(k, 200.0)
    assert sorted(lc.samples()["lifetime_s"]) == sorted(200.0 - t for t in born.values())


def test_sampling_must_be_a_power_of_two() -> None:
    for bad in (0, 3, 12, True, 2.0):
        with pytest.raises(ValueError, match="sample_every"):
            Lifecycle(sample_every=bad)  # type: ignore[arg-type]


def test_a_weighted_histogram_with_samples_counts_each_sample_weight_times() -> None:
    h = Histogram(keep_samples=True, weight=4)
    for v in (0.5, 5.0, 50.0):
        h.observe(v)
    assert h.buckets()[-1] == ("+Inf", 12) and h.total() == pytest.approx(4 * 55.5)
