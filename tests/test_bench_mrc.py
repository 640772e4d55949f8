"""Exact LRU stack distances and prefix-rule miss-ratio curves, checked by hand and against a plain LRU."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.bench.mrc import build_mrc, stack_distances
from kvstrata.trace.reader import Trace, TraceBuilder, load_trace

DATA = Path(__file__).parent / "data"
MOONCAKE = Path("/work/shared/traces/mooncake_conversation.jsonl")


def lru_prefix_hits(requests: list[list[int]], capacity: int) -> int:
    """Reference: one LRU of ``capacity`` blocks; prefix hits counted before the request's blocks are touched."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for blocks in requests:
        for b in blocks:
            if b not in cache:
                break
            hits += 1
        for b in blocks:
            cache[b] = None
            cache.move_to_end(b)
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def trace_of(requests: list[list[int]]) -> Trace:
    b = TraceBuilder("t", "mooncake", 1)
    for i, blocks in enumerate(requests):
        b.add_ids(float(i), blocks, len(blocks), 0)
    return b.build()


def test_stack_distances_by_hand() -> None:
    #        0  1  2  3  4  5  6  7  8  9
    acc = [1, 2, 3, 1, 2, 4, 5, 1, 2, 3]
    dist, prev = stack_distances(acc)
    assert dist == [-1, -1, -1, 2, 2, -1, -1, 3, 3, 4]
    assert prev == [-1, -1, -1, 0, 1, -1, -1, 3, 4, 2]
    assert stack_distances([7, 7, 7])[0] == [-1, 0, 0]


def test_curve_points_by_hand() -> None:
    # requests [10 20 30] [10 20 40] [50] [10 20 30]; per-request running max of the distances:
    # r1: 2 2 cold, r3: 3 3 4 -> C<=2: 0 hits, C=3: 2, C=4: 4, C>=5: 5 of 10 accesses
    sp = build_mrc(load_trace(DATA / "small_mooncake.jsonl"))
    m = sp.mrc
    assert [m.hits(c) for c in range(0, 7)] == [0, 0, 0, 2, 4, 5, 5]
    assert m.ideal_hit_rate == 0.5 and m.saturation_blocks == 5
    assert m.capacity_for(0.4) == 4 and m.capacity_for(0.41) == 5 and m.capacity_for(0.6) is None
    assert m.capacity_for(0.0) == 0
    assert dict(m.points())[4] == pytest.approx(0.4)
    assert sorted(sp.reuse_gaps_s().tolist()) == [1.0, 1.0, 3.0, 3.0, 4.0]


def test_prefix_rule_blocks_hits_after_a_miss() -> None:
    # block 2 is cached but block 9 in front of it is new: 2 is not a hit
    m = build_mrc(trace_of([[1, 2], [9, 2]])).mrc
    assert m.hits(100) == 0 and m.ideal_hit_rate == 0.0


def test_last_token_rule_for_token_traces() -> None:
    b = TraceBuilder("t", "kvstrata", 4)
    b.add_tokens(0.0, list(range(8)), 0)
    b.add_tokens(1.0, list(range(8)), 0)     # 8 tokens: 2 full blocks, only the first may hit
    m = build_mrc(b.build()).mrc
    assert m.hits(10) == 1 and m.accesses == 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), min_size=0, max_size=6, unique=True), min_size=1, max_size=25),
       st.integers(1, 15))
def test_curve_equals_plain_lru_at_every_capacity(requests: list[list[int]], capacity: int) -> None:
    m = build_mrc(trace_of(requests)).mrc
    assert m.hits(capacity) == lru_prefix_hits(requests, capacity)


@pytest.mark.slow
@pytest.mark.skipif(not MOONCAKE.exists(), reason="shared Mooncake trace not present")
def test_mooncake_ideal_and_curve_points() -> None:
    tr = load_trace(MOONCAKE)
    assert (len(tr.requests), tr.num_accesses, tr.num_distinct_blocks) == (12031, 288500, 182790)
    m = build_mrc(tr).mrc
    assert m.ideal_hit_rate == pytest.approx(1 - 182790 / 288500)     # the README's 36.6%
    reqs = [r.blocks for r in tr.requests]
    for tokens in (3_000_000, 20_000_000):
        cap = tokens // 512
        assert m.hits(cap) == lru_prefix_hits(reqs, cap)
    # the paper's Figure 9: 3M tokens reach less than half of the ideal, ~50M nearly all of it
    assert m.hit_rate(3_000_000 // 512) < 0.5 * m.ideal_hit_rate
    assert m.hit_rate(50_000_000 // 512) > 0.95 * m.ideal_hit_rate
    assert np.all(np.diff([m.hit_rate(c) for c in range(0, 200_000, 5000)]) >= 0)
