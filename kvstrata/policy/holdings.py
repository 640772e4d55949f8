"""What the tiers below the device hold, and which open plans pin what.

:class:`Holdings` is the tier policy's bookkeeping, with no decisions in it:
one index per local tier that holds blocks (a slab tier: a
:class:`~kvstrata.policy.slot_index.SlotIndex`; a persistent one: :func:`keyed_index`),
the keys each open plan pinned in each, and the tombstones of keys forgotten while pinned.

A key forgotten while pinned leaves its tier at once (lookups stop finding
it, a later store places it again); its entry is renamed to a tombstone key
that keeps the slot and the pins until the plans that pinned it complete,
and every open plan's pin list refers to the tombstone from then on.

Threading: owned by the policy's owner thread, like the policy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Container, Iterable

from kvstrata.policy.compact_index import CompactIndex
from kvstrata.policy.slot_index import SlotIndex
from kvstrata.policy.tiers import Tier
from kvstrata.system.values import LRU

if TYPE_CHECKING:
    from kvstrata.policy.orders import OrderContext

__all__ = ["Holdings", "TOMBSTONE_PREFIX", "COMPACT_ABOVE", "keyed_index", "index_bytes"]

TOMBSTONE_PREFIX = b"\x00kvstrata-tombstone:"  # + a counter: the key a forgotten pinned entry takes


#: SSD tiers of more blocks than this are indexed in flat arrays (see :func:`keyed_index`).
COMPACT_ABOVE = 1 << 20


def keyed_index(num_slots: int, eviction: str = LRU, context: "OrderContext | None" = None) -> SlotIndex | CompactIndex:
    """The SSD tier's index: a large disk of small blocks holds tens of millions of them, and
    a :class:`CompactIndex` costs ~50 bytes per key where a :class:`SlotIndex` costs ~165;
    below :data:`COMPACT_ABOVE` slots (at most ~170 MB either way) the dict-based index is
    kept for its speed (lookups are ~2x faster: ``kvstrata bench`` replays millions). The
    compact index keeps LRU order only: another ``eviction`` takes the dict-based one."""
    if num_slots > COMPACT_ABOVE and eviction == LRU:
        return CompactIndex(num_slots)
    return SlotIndex(num_slots, eviction, context)


def index_bytes(num_slots: int, key_len: int = 32, eviction: str = LRU) -> int:
    """What the SSD tier's index costs in memory once the tier is full (an upper estimate:
    the key, the LRU links, the hash table at its fullest; measured ~49 bytes for 32-byte
    keys), for the driver to check against the machine before it starts."""
    if num_slots <= COMPACT_ABOVE or eviction != LRU:
        # another order keeps its own dicts and ghost keys (measured 316 and 523 bytes per block
        # for arc and s3fifo at 100,000 blocks, keys aside)
        return num_slots * (key_len + 140 if eviction == LRU else 2 * key_len + 560)
    return num_slots * (key_len + 20)


class Holdings:
    """The local tiers' indexes with the pins of open plans, by tier name (``context``: what
    their eviction orders may weigh blocks by, :class:`~kvstrata.policy.orders.OrderContext`)."""

    def __init__(self, tiers: Iterable[Tier], context: "OrderContext | None" = None) -> None:
        self.indexes: dict[str, SlotIndex | CompactIndex] = {
            t.name: SlotIndex(t.capacity, t.eviction, context) if t.slab
            else keyed_index(t.capacity, t.eviction, context)
            for t in tiers if not t.shared and t.capacity}
        self._pins: dict[int, dict[str, list[bytes]]] = {}  # plan -> tier -> keys it pinned there
        self._tombs: dict[str, set[bytes]] = {name: set() for name in self.indexes}
        self._next_tomb = 0

    def index(self, tier: str) -> SlotIndex | CompactIndex | None:
        return self.indexes.get(tier)

    def held(self, tier: str) -> Container[bytes]:
        """Membership of ``tier`` (an empty container when it holds nothing)."""
        index = self.indexes.get(tier)
        if index is None:
            return {}
        return index._slot if isinstance(index, SlotIndex) else index

    def open(self, plan_id: int) -> None:
        self._pins[plan_id] = {}

    def _pinned(self, plan_id: int, tier: str) -> list[bytes]:
        return self._pins[plan_id].setdefault(tier, [])

    def pin(self, tier: str, plan_id: int, keys: list[bytes]) -> list[int]:
        """Pin present ``keys`` in ``tier`` until the plan completes; returns their slots."""
        index = self.indexes[tier]
        self._pinned(plan_id, tier).extend(keys)
        return index.pin_many(keys)

    def place(self, tier: str, plan_id: int, keys: list[bytes]
              ) -> tuple[dict[bytes, int], list[tuple[bytes, int]]]:
        """Slots for ``keys`` the tier does not hold, pinned for the plan: ``(placed key ->
        slot, evicted (key, slot))``. Keys that found no room (every other slot pinned) are
        not placed."""
        index = self.indexes[tier]
        if len(set(keys)) != len(keys):
            keys = list(dict.fromkeys(keys))  # one slot and one pin per key
        slots, evicted = index.allocate_absent(keys, pin=True)
        placed = dict(zip(keys, slots)) if None not in slots else {k: s for k, s in zip(keys, slots) if s is not None}
        self._pinned(plan_id, tier).extend(placed)
        return placed, evicted  # type: ignore[return-value]

    def release(self, plan_id: int) -> None:
        """The plan completed: drop its pins (and the tombstones it was the last to hold)."""
        for tier, keys in self._pins.pop(plan_id, {}).items():
            if not keys:
                continue
            index, tombs = self.indexes[tier], self._tombs[tier]
            index.unpin_many(keys)
            if tombs:
                for tomb in [k for k in keys if k in tombs and not index.pin_count(k)]:
                    tombs.discard(tomb)
                    index.pop(tomb)

    def forget(self, tier: str, keys: Iterable[bytes]) -> list[bytes]:
        """Drop ``keys`` from ``tier`` now; returns those it held."""
        index = self.indexes.get(tier)
        if index is None:
            return []
        present = [k for k in dict.fromkeys(keys) if k in index]
        for key in present:
            if index.pin_count(key):
                self._bury(tier, key)
            else:
                index.pop(key)
        return present

    def _bury(self, tier: str, key: bytes) -> None:
        self._next_tomb += 1
        tomb = TOMBSTONE_PREFIX + b"%d" % self._next_tomb
        self.indexes[tier].rename(key, tomb)
        self._tombs[tier].add(tomb)
        for pins in self._pins.values():
            held = pins.get(tier)
            if held and key in held:
                held[:] = [tomb if k == key else k for k in held]

    def check(self) -> None:
        """Assert that every pin belongs to an open plan and every tombstone is still pinned."""
        for tier, index in self.indexes.items():
            index.check()
            held: dict[bytes, int] = {}
            for pins in self._pins.values():
                for key in pins.get(tier, ()):
                    held[key] = held.get(key, 0) + 1
            for key, n in held.items():
                assert index.pin_count(key) == n, (
                    f"{tier} key {key.hex()[:12]}: plans hold {n} pins, the index counts {index.pin_count(key)}")
            stray = [k for k in index._pins if k not in held]
            assert not stray, f"{len(stray)} {tier} pins no open plan holds"
            assert all(index.pin_count(t) for t in self._tombs[tier]), f"a {tier} tombstone outlived its pins"
