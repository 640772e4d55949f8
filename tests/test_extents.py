"""The page file's free-space map against a page-by-page reference."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.tiers.ssd.extents import ExtentMap


def test_best_fit_prefers_the_smallest_hole_and_grows_last():
    m = ExtentMap(100, used=[(0, 10), (12, 8), (25, 5)])  # holes: 10-12 (2), 20-25 (5), 30-100
    assert m.free_pages == 2 + 5 + 70 and m.high_water == 30 and m.largest() == 70
    assert m.allocate(2) == 10
    assert m.allocate(3) == 20      # the 5-page hole, not the tail
    assert m.allocate(2) == 23
    assert m.allocate(4) == 30      # no hole left: the file grows
    assert m.high_water == 34


def test_free_merges_neighbours_and_limit_bounds_everything():
    m = ExtentMap(10)
    a, b, c = m.allocate(3), m.allocate(3), m.allocate(4)
    assert (a, b, c) == (0, 3, 6) and m.allocate(1) is None and m.free_pages == 0
    m.free(a, 3)
    m.free(c, 4)
    assert m.allocate(5) is None    # 3 + 4 free, but not contiguous
    m.free(b, 3)
    assert m.largest() == 10 and m.high_water == 0
    with pytest.raises(ValueError):
        m.free(0, 3)                # already free


def test_extents_past_the_limit_are_never_handed_out():
    m = ExtentMap(8, used=[(6, 4)])  # a record left from a larger capacity
    assert m.free_pages == 6 and m.high_water == 10  # the file keeps the record's pages
    m.free(6, 4)
    assert m.free_pages == 8 and m.allocate(9) is None and m.allocate(8) == 0


def test_overlapping_reports_later_extents():
    assert ExtentMap.overlapping([(0, 4), (10, 2), (3, 2), (11, 1), (12, 1)]) == [(3, 2), (11, 1)]


def free_runs(taken: list[bool]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, t in enumerate(taken + [True]):
        if not t and start is None:
            start = i
        elif t and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12)), max_size=80),
       st.integers(1, 64))
def test_matches_a_page_bitmap(ops, limit):
    m = ExtentMap(limit)
    taken = [False] * limit
    live: list[tuple[int, int]] = []
    for alloc, n in ops:
        if alloc or not live:
            runs = free_runs(taken)
            start = m.allocate(n)
            fits = [length for s, length in runs if length >= n]
            if start is None:
                assert not fits                 # it fails only when nothing fits
                continue
            assert (start, min(fits)) in runs   # best fit, from the start of that hole
            taken[start:start + n] = [True] * n
            live.append((start, n))
        else:
            start, n = live.pop(n % len(live))
            m.free(start, n)
            taken[start:start + n] = [False] * n
        assert m.free_pages == taken.count(False)
        assert m.high_water == max((s + n for s, n in live), default=0)
        assert m.largest() == max((length for _, length in free_runs(taken)), default=0)
