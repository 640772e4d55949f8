"""Key -> slot bookkeeping with LRU order and pins, over a fixed number of slots.

Pure Python, no bytes: the tier policy keeps one per lower tier (the CPU
slab's slots; the SSD tier's record budget), and :class:`kvstrata.tiers.host.CPUTier`
pairs one with a slab for standalone use.

Keys are ``bytes`` (block hashes). Not thread-safe: one owner thread, or the
caller serialises access.

Pin rule: a pinned entry is never evicted, popped or handed to another key;
pin an entry for as long as a copy into or out of its slot is in flight.
Pinning counts as use: when the last pin is released the entry becomes the
most recently used.

Memory follows occupancy, not capacity: slots that were never used are
handed out from a counter, so an index of 10^9 slots holding 10 keys costs
what 10 keys cost.
"""

from __future__ import annotations

from itertools import islice
from typing import TYPE_CHECKING, Any, Collection, Iterable, Iterator, Sequence

from kvstrata.errors import ConfigError
from kvstrata.policy.eviction import LRU, EvictionOrder, make_order

if TYPE_CHECKING:
    from kvstrata.policy.orders import OrderContext

__all__ = ["SlotIndex", "SlotCounts", "PinnedError"]


class PinnedError(RuntimeError):
    """The operation needs a slot that is pinned (every slot pinned, or popping a pinned key)."""


def check_key(key: object, what: str = "key") -> bytes:
    if not isinstance(key, bytes):
        raise ValueError(f"{what}: expected bytes (a block hash), got {type(key).__name__}")
    return key


def check_keys(keys: Collection[object], what: str = "keys") -> None:
    """:func:`check_key` for every key, with one C-level pass when all are plain ``bytes``."""
    if not set(map(type, keys)) <= {bytes}:
        for key in keys:
            check_key(key, what)


class SlotCounts:
    """What both indexes keep alike: slots handed out lowest first from a counter, freed
    slots reused most recently freed first, and pin counts by key."""

    __slots__ = ()
    num_slots: int
    _free: Any      # a list or an array of freed slots
    _unused: int    # slots >= this were never handed out
    _pins: dict[bytes, int]

    @property
    def num_free(self) -> int:
        """Slots holding no entry."""
        return len(self._free) + self.num_slots - self._unused

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def pinned_among(self, keys: Iterable[bytes]) -> set[bytes]:
        """The keys of ``keys`` that hold at least one pin."""
        return self._pins.keys() & keys if self._pins else set()

    def pin_count(self, key: bytes) -> int:
        """How many pins ``key`` holds (0 when unpinned or absent)."""
        return self._pins.get(key, 0)

    def _take_free(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self._unused < self.num_slots:
            self._unused += 1
            return self._unused - 1
        return None


class SlotIndex(SlotCounts):
    """Key -> slot mapping with an eviction order and pin counts over ``num_slots`` slots.

    Unpinned entries live in an eviction order (:mod:`kvstrata.policy.eviction`;
    ``lru`` by default: an ordered dict, front = least recently used) so that
    eviction is O(1) even when many entries are pinned; pinned entries are
    held aside with their counts until released. Iteration yields keys in
    eviction order: unpinned entries least recently used first, then pinned
    entries in the order they were pinned. Slots are handed out lowest first
    while never-used slots remain; freed slots are reused most recently freed
    first.
    """

    __slots__ = ("num_slots", "_slot", "_lru", "_pins", "_free", "_unused")

    def __init__(self, num_slots: int, eviction: str = LRU, context: "OrderContext | None" = None) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ConfigError(f"num_slots: expected a positive integer, got {num_slots!r}")
        self.num_slots = num_slots
        self._slot: dict[bytes, int] = {}
        self._lru: EvictionOrder = make_order(eviction, num_slots, context=context)
        self._pins: dict[bytes, int] = {}
        self._free: list[int] = []   # freed slots; pop() reuses the most recently freed
        self._unused = 0             # slots >= this were never handed out

    # ------------------------------------------------------------------ queries

    def __contains__(self, key: object) -> bool:
        return key in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def __iter__(self) -> Iterator[bytes]:
        yield from list(self._lru)
        yield from list(self._pins)

    def lookup(self, key: bytes) -> int | None:
        """The slot of ``key``, or None; does not change recency."""
        return self._slot.get(check_key(key))

    def lookup_many(self, keys: Sequence[bytes]) -> list[int | None]:
        """:meth:`lookup` for each key: slots (None where absent); no recency change."""
        check_keys(keys)
        return list(map(self._slot.get, keys))

    def lru_keys(self, n: int | None = None) -> list[bytes]:
        """Up to ``n`` unpinned keys, least recently used first (all when ``n`` is None)."""
        return list(self._lru if n is None else islice(self._lru, n))

    # ------------------------------------------------------------------ updates

    def touch(self, key: bytes) -> bool:
        """Mark ``key`` used; False if absent. Pinned keys count the use on unpin."""
        if key in self._lru:
            self._lru.access(key)
            return True
        return key in self._pins

    def touch_many(self, keys: Iterable[bytes]) -> None:
        """:meth:`touch` each key in turn (absent keys are skipped)."""
        lru = self._lru
        access = lru.access
        for key in keys:
            if key in lru:
                access(key)

    def _take_free_many(self, n: int) -> list[int]:
        """Up to ``n`` free slots, in the order :meth:`_take_free` would hand them out."""
        k = min(n, len(self._free))
        out = self._free[len(self._free) - k:][::-1]
        del self._free[len(self._free) - k:]
        fresh = min(n - k, self.num_slots - self._unused)
        out += range(self._unused, self._unused + fresh)
        self._unused += fresh
        return out

    def allocate(self, key: bytes) -> tuple[int, bytes | None]:
        """Give ``key`` a slot, evicting the least recently used unpinned entry if full.

        Returns ``(slot, evicted_key)``; ``evicted_key`` is None when a free slot
        was used or ``key`` was already present (then its own slot is returned
        and it becomes most recently used). The evicted entry is gone from the
        index, but its bytes stay in the slot until the caller overwrites them.
        Raises :class:`PinnedError` when every slot is pinned.
        """
        got = self.try_allocate(key)
        if got is None:
            raise PinnedError(f"all {self.num_slots} slots are pinned; cannot place a new block")
        return got

    def try_allocate(self, key: bytes) -> tuple[int, bytes | None] | None:
        """Like :meth:`allocate`, but returns None when every slot is pinned."""
        slot = self._slot.get(check_key(key))
        if slot is not None:
            self.touch(key)
            return slot, None
        evicted = None
        slot = self._take_free()
        if slot is None:
            evicted = self._lru.evict(key)
            if evicted is None:
                return None
            slot = self._slot.pop(evicted)
        self._slot[key] = slot
        self._lru.add(key)
        return slot, evicted

    def allocate_many(self, keys: Sequence[bytes], *, pin: bool = False
                      ) -> tuple[list[int | None], list[tuple[bytes, int]]]:
        """:meth:`try_allocate` each key in turn, except that no key given a slot by
        this call is evicted to place a later one.

        Returns ``(slots, evicted)``: ``slots[i]`` is the slot of ``keys[i]``, or
        None when every other slot is pinned or taken by an earlier key of the
        batch; ``evicted`` lists the evicted entries as ``(key, slot)``, least
        recently used first (their bytes are still in those slots). ``pin``: every
        key that got a slot also gets a pin (as :meth:`pin_many` would).
        """
        check_keys(keys)
        if len(keys) == len(set(keys)) and self._slot.keys().isdisjoint(keys):
            return self._allocate_new(keys, pin)
        slots, evicted = self._allocate_each(keys)
        if pin:
            self.pin_many([k for k, s in zip(keys, slots) if s is not None])
        return slots, evicted

    def allocate_absent(self, keys: Sequence[bytes], *, pin: bool = False
                        ) -> tuple[list[int | None], list[tuple[bytes, int]]]:
        """:meth:`allocate_many` for keys the caller knows are distinct ``bytes`` and absent
        (not checked: the tier policy's hot path)."""
        return self._allocate_new(keys, pin)

    def _allocate_new(self, keys: Sequence[bytes], pin: bool
                      ) -> tuple[list[int | None], list[tuple[bytes, int]]]:
        """:meth:`allocate_many` for distinct keys that are all absent."""
        slots: list[int | None] = list(self._take_free_many(len(keys)))
        lru = self._lru
        evict, base = lru.evict, len(slots)
        victims = [evict(keys[base + i]) for i in range(min(len(keys) - base, len(lru)))]
        slot_of = self._slot
        freed = [slot_of.pop(key) for key in victims]  # type: ignore[arg-type]
        slots += freed
        placed = keys[:len(slots)]
        slot_of.update(zip(placed, slots))
        if pin:
            pins = self._pins
            for key in placed:
                pins[key] = 1
        else:
            lru.add_many(placed)  # type: ignore[arg-type]
        slots += [None] * (len(keys) - len(slots))
        return slots, list(zip(victims, freed))  # type: ignore[arg-type]

    def _allocate_each(self, keys: Sequence[bytes]
                       ) -> tuple[list[int | None], list[tuple[bytes, int]]]:
        """:meth:`allocate_many` one key at a time (repeated or present keys). Keys this call
        places or uses are never evicted for a later one: under LRU they sit at the most
        recent end, behind every victim; under another order they are held out of its reach
        until the call ends, then returned in the call's order."""
        order = self._lru
        lru = order.recent_last
        slots: list[int | None] = []
        evicted: list[tuple[bytes, int]] = []
        placed: set[bytes] = set()  # LRU: this call's keys in the order, all behind the others
        held: list[bytes] = []
        new: list[bytes] = []
        for key in keys:
            slot = self._slot.get(key)
            if slot is not None:
                if key in order:
                    order.access(key)
                    if lru:
                        placed.add(key)
                    else:
                        order.hold(key)
                        held.append(key)
                slots.append(slot)
                continue
            slot = self._take_free()
            if slot is None:
                victim = order.evict(key) if len(order) > len(placed) else None
                if victim is None:
                    slots.append(None)
                    continue
                slot = self._slot.pop(victim)
                evicted.append((victim, slot))
            self._slot[key] = slot
            if lru:
                order.add(key)
                placed.add(key)
            else:
                new.append(key)
            slots.append(slot)
        for key in held:
            order.release(key, use=False)
        order.add_many(new)
        return slots, evicted

    def pop(self, key: bytes) -> int | None:
        """Remove ``key`` and free its slot; return the slot or None if absent.

        Raises :class:`PinnedError` if ``key`` is pinned.
        """
        slot = self._slot.get(check_key(key))
        if slot is None:
            return None
        if key in self._pins:
            raise PinnedError(f"key {key.hex()[:16]}... is pinned; unpin it before popping")
        del self._slot[key]
        self._lru.discard(key)
        self._free.append(slot)
        return slot

    def rename(self, key: bytes, new_key: bytes) -> None:
        """Give ``key``'s entry (slot, pins, recency) to the absent ``new_key``."""
        if new_key in self._slot:
            raise ValueError("new_key: already present")
        self._slot[new_key] = self._slot.pop(key)
        if key in self._pins:
            self._pins[new_key] = self._pins.pop(key)
            self._lru.rename_held(key, new_key)
        else:
            self._lru.rename(key, new_key)

    def pin(self, key: bytes) -> int:
        """Add one pin to ``key`` and return its slot; KeyError if absent."""
        slot = self._slot.get(check_key(key))
        if slot is None:
            raise KeyError(key)
        count = self._pins.get(key, 0)
        if count == 0:
            self._lru.hold(key)
        self._pins[key] = count + 1
        return slot

    def pin_many(self, keys: Sequence[bytes]) -> list[int]:
        """:meth:`pin` each key (all must be present); returns their slots."""
        slot_of, pins, lru = self._slot, self._pins, self._lru
        out = []
        for key in keys:
            slot = slot_of[key]
            count = pins.get(key, 0)
            if not count:
                lru.hold(key)
            pins[key] = count + 1
            out.append(slot)
        return out

    def unpin_many(self, keys: Sequence[bytes]) -> None:
        """:meth:`unpin` each key in turn."""
        pins, lru = self._pins, self._lru
        for key in keys:
            count = pins.get(key, 0)
            if count == 1:
                del pins[key]
                lru.release(key)
            elif count:
                pins[key] = count - 1
            else:
                raise RuntimeError(f"unpin of key {key.hex()[:16]}... that holds no pin")

    def unpin(self, key: bytes) -> None:
        """Release one pin; the entry becomes most recently used when the last pin goes."""
        count = self._pins.get(check_key(key), 0)
        if count == 0:
            raise RuntimeError(f"unpin of key {key.hex()[:16]}... that holds no pin")
        if count == 1:
            del self._pins[key]
            self._lru.release(key)
        else:
            self._pins[key] = count - 1

    def check(self) -> None:
        """Assert the accounting invariants (for tests and debugging)."""
        assert len(self._slot) + self.num_free == self.num_slots, (
            f"entries {len(self._slot)} + free {self.num_free} != slots {self.num_slots}")
        assert len(self._lru) + len(self._pins) == len(self._slot), (
            f"unpinned {len(self._lru)} + pinned {len(self._pins)} != entries {len(self._slot)}")
        assert set(self._lru).isdisjoint(self._pins), "a key is both pinned and in the LRU list"
        used = set(self._slot.values())
        free = set(self._free)
        assert len(used) == len(self._slot) and used.isdisjoint(free), "a slot is shared"
        assert all(s < self._unused for s in used | free), "a slot beyond the handed-out range"
