"""The shutdown rule: which device-resident blocks a graceful close persists.

The policy (``prepare_store(..., SHUTDOWN)``) and the vLLM worker (its mirror of
the device pool's recency) both apply it, so it lives here once.
"""

from __future__ import annotations

from typing import Callable, Iterable

__all__ = ["select_for_shutdown"]


def select_for_shutdown(offered_mru_first: Iterable[tuple[int, bytes]], persisted: Callable[[bytes], bool],
                        limit: int) -> tuple[list[tuple[int, bytes]], list[bytes]]:
    """The shutdown rule: the hot set is the ``limit`` most recently used device blocks
    offered (most recent first). Returns ``(to store, already held)``: the hot blocks the
    persistent tier lacks and the hot keys it holds, both least recently used first (so
    that, stored or touched in that order, the most recent end up most recent)."""
    store: list[tuple[int, bytes]] = []
    held: list[bytes] = []
    seen: set[bytes] = set()
    for block, key in offered_mru_first:
        if len(seen) >= limit:
            break
        if key in seen:
            continue
        seen.add(key)
        if persisted(key):
            held.append(key)
        else:
            store.append((block, key))
    store.reverse()
    held.reverse()
    return store, held
