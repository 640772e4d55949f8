"""Where a hit may end when several pools must be restored together (hybrid models).

A hybrid model's prefix is served from several pools at once: the KV pages, every one of
them from the first, and pools whose pages only matter at the end of the prefix (a Mamba
state, a sliding window's last pages). Such a pool holds its pages with gaps (a state is
kept at some page boundaries only), so each pool has a set of *legal end points*: the
prefix lengths, in pages, it can restore. A hit may end only where every pool can:

* :func:`legal_ends`: one pool's end points up to ``limit`` pages, from which of its pages
  are held: every page before the end (``window`` None) or the last ``window`` pages;
* :func:`common_ends`: the end points every pool shares, ascending; the hit is the last.

Taking the minimum of each pool's longest prefix instead is wrong: with KV pages held up
to page 3 and states at ends 2 and 5, the minimum, 3, is no end the state pool can restore;
the answer is 2.
"""

from __future__ import annotations

from typing import Iterable, Sequence

__all__ = ["legal_ends", "common_ends"]


def legal_ends(held: Sequence[bool], limit: int, window: int | None = None) -> set[int]:
    """The prefix lengths ``1..limit`` (pages) a pool holding ``held[i]`` for page ``i`` can
    restore: every page before the end (``window`` None) or the ``window`` pages before it."""
    limit = min(limit, len(held))
    if window is None:
        run = next((i for i in range(limit) if not held[i]), limit)
        return set(range(1, run + 1))
    if window < 1:
        raise ValueError(f"window: expected at least 1 page, got {window}")
    return {end for end in range(1, limit + 1) if all(held[max(0, end - window):end])}


def common_ends(pools: Iterable[set[int]]) -> list[int]:
    """The end points every pool in ``pools`` shares, ascending (none: an empty list)."""
    shared: set[int] | None = None
    for ends in pools:
        shared = set(ends) if shared is None else shared & ends
    return sorted(shared or ())
