"""Hit accounting, written once (kvstrata.core.hits) and used by every driver: a block
fetched from the remote tier into a CPU slot is a remote hit, in the per-tier counts and in
each request's counts alike."""

from __future__ import annotations

from pathlib import Path

from kvstrata.bench.replay import ReplayOptions, replay
from kvstrata.config.schema import KVStrataConfig
from kvstrata.core.hits import count_tiers, request_counts, served_from
from kvstrata.policy import PolicySpec, TierPolicy
from kvstrata.trace.reader import TraceBuilder


def test_a_block_fetched_into_a_cpu_slot_is_a_remote_hit() -> None:
    tiers, keys = ["ssd", "cpu", "cpu", "cpu"], [b"a", b"b", b"c", b"d"]
    assert served_from(tiers, keys) == tiers
    named = {"slab": "cpu", "shared": "remote"}
    assert served_from(tiers, keys, {b"b", b"c"}, **named) == ["ssd", "remote", "remote", "cpu"]
    assert served_from(tiers, keys, {b"b", b"c"}, loaded=2, **named) == ["ssd", "remote"]
    assert served_from(tiers, keys, {b"a"}, **named) == tiers  # read from the SSD tier: an SSD hit whatever its origin


def test_request_counts_name_every_tier_of_the_deployment() -> None:
    with_remote = TierPolicy(PolicySpec(slab_slots=4, store_slots=4, shared=True))
    without = TierPolicy(PolicySpec(slab_slots=4, store_slots=4))
    assert count_tiers(with_remote) == ("gpu", "cpu", "ssd", "remote") and count_tiers(without) == ("gpu", "cpu", "ssd")
    assert request_counts(2, ["ssd", "remote", "cpu"], count_tiers(with_remote)) == {
        "gpu": 2, "cpu": 1, "ssd": 1, "remote": 1}
    assert request_counts(0, [], count_tiers(without)) == {"gpu": 0, "cpu": 0, "ssd": 0}


def test_the_replays_per_request_counts_add_up_to_its_per_tier_counts_remote_included(tmp_path: Path) -> None:
    """Regression: each request's counts carried gpu, cpu and ssd only, so the remote hits the
    per-tier counts had were in no request."""
    b = TraceBuilder("t", "mooncake", 4)
    turns = [[1, 2, 3], [11, 12, 13], [21, 22, 23], [1, 2, 3, 4], [11, 12, 13, 14], [21, 22, 5], [1, 2, 3, 4, 6]]
    for i, ids in enumerate(turns):
        b.add_ids(float(i), ids, 4 * len(ids), 0)
    config = KVStrataConfig.from_dict({"block_size": 4, "model": {"block_nbytes": 1024},
                                       "gpu": {"num_blocks": 5}, "cpu": {"capacity": 3 * 1024},
                                       "ssd": {"path": str(tmp_path / "ssd"), "capacity": 0},
                                       "remote": {"url": "redis://cache:6379/0", "capacity": 64 * 1024}})
    r = replay(b.build(), config, ReplayOptions(record_requests=True))
    assert r.hit_blocks["remote"] > 0, r.hit_blocks
    assert len(r.request_hits) == len(turns)
    summed = {t: sum(h.get(t, 0) for h in r.request_hits) for t in r.hit_blocks}
    assert summed == r.hit_blocks
    assert all(set(h) == set(r.hit_blocks) for h in r.request_hits)
