"""Eviction orders: which unpinned entry of a tier's index leaves when it needs a slot.

Each is an :class:`~kvstrata.policy.orders.EvictionOrder` registered by its name
(:mod:`kvstrata.policy.orders`); :func:`make_order` builds the one a tier's ``eviction`` names.

A :class:`~kvstrata.policy.slot_index.SlotIndex` keeps its unpinned keys in one of
these (its pinned keys are *held*: out of reach of eviction, their state kept).
Every order holds keys only, never bytes, and costs O(1) amortised per operation.
The verbs, as the index calls them:

* ``add(key)``: a new entry (just placed, or released after a pin placed it);
* ``access(key)``: a use of a present, unpinned entry (a hit, a refresh);
* ``hold(key)`` / ``release(key)``: a pin and the release of its last pin (a use:
  pins are taken for hits and the copies of stores);
* ``discard(key)``: the entry is gone (popped);
* ``evict(incoming)``: remove and return the entry to evict to make room for
  ``incoming`` (ARC's choice depends on it), or None when none is unpinned;
* iteration: the entries, those to be evicted first first (an estimate where
  the order reinserts on the way, as S3-FIFO and ARC do).

Policies (``cpu.eviction``, ``ssd.eviction``):

* ``lru``: least recently used (the default; what the exact miss-ratio curve of
  ``kvstrata bench`` models).
* ``s3fifo``: S3-FIFO (Yang et al., SOSP'23): a small FIFO of 10% of the slots
  for new entries, a main FIFO, and a ghost of the keys the small one evicted
  (as many as the main one holds). An entry used while in the small FIFO moves
  to the main one when it reaches the head; the main one reinserts an entry
  used since it last passed the head (a 2-bit count, decremented on the way).
  A key found in the ghost enters the main FIFO directly. One-hit wonders
  leave quickly, which is what a prefix cache's long tail of unshared suffixes
  looks like.
* ``arc``: ARC (Megiddo and Modha, FAST'03): a recency list T1 and a frequency
  list T2, their ghosts B1 and B2, and a target size ``p`` for T1 that a hit in
  B1 raises and a hit in B2 lowers.
* ``cost`` (``cost:<alpha>``): recency plus ``alpha`` times what recomputing the
  block costs for its bytes, which grows with its position in the prompt
  (:mod:`kvstrata.policy.cost_eviction`, after Marconi, MLSys'25).

A released entry goes back to the end its policy gives a use (LRU: most recent;
S3-FIFO: the tail of its FIFO with its count raised; ARC: T2's most recent end).

Another order: a subclass of :class:`~kvstrata.policy.orders.EvictionOrder` with a ``name``,
registered with :func:`~kvstrata.policy.orders.register_order` before the config naming it
is read (tests/test_eviction_registry.py registers one).

Threading: owned by the index's owner thread.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator

from kvstrata.policy.cost_eviction import CostOrder
from kvstrata.policy.orders import EvictionOrder, OrderContext, order_class, register_order
from kvstrata.system.values import ARC, EVICTIONS, LRU, S3FIFO, check_eviction, eviction_name

__all__ = ["EVICTIONS", "LRU", "S3FIFO", "ARC", "LRUOrder", "S3FIFOOrder", "ARCOrder", "CostOrder", "EvictionOrder",
           "OrderContext", "make_order"]


@register_order
class LRUOrder(OrderedDict, EvictionOrder):  # type: ignore[type-arg,misc]
    """Least recently used first (an ordered dict: front = next victim)."""

    name = LRU
    recent_last = True

    @classmethod
    def create(cls, num_slots: int, value: str, context: OrderContext) -> "LRUOrder":
        return cls()

    def add(self, key: bytes) -> None:
        self[key] = None

    def add_many(self, keys: list[bytes]) -> None:
        self.update(dict.fromkeys(keys))

    access = OrderedDict.move_to_end

    def release(self, key: bytes, use: bool = True) -> None:
        self[key] = None

    def hold(self, key: bytes) -> None:
        del self[key]

    def rename_held(self, key: bytes, new_key: bytes) -> None:
        pass  # a held key has no state here

    def rename(self, key: bytes, new_key: bytes) -> None:
        del self[key]
        self[new_key] = None  # most recently used: a renamed entry is on its way out anyway

    def discard(self, key: bytes) -> None:
        del self[key]

    def evict(self, incoming: bytes | None = None) -> bytes | None:
        if not self:
            return None
        return self.popitem(last=False)[0]


@register_order
class S3FIFOOrder(EvictionOrder):
    """S3-FIFO over ``num_slots`` slots (see the module docstring)."""

    name = S3FIFO

    SMALL = 0.10     # the small FIFO's share of the slots
    MAX_FREQ = 3     # a 2-bit count of uses

    def __init__(self, num_slots: int) -> None:
        self.small_target = max(1, int(self.SMALL * num_slots))
        self.ghost_size = max(1, num_slots - self.small_target)
        self._small: OrderedDict[bytes, None] = OrderedDict()
        self._main: OrderedDict[bytes, None] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._freq: dict[bytes, int] = {}
        self._held: dict[bytes, bool] = {}  # held key -> was it in the main FIFO

    def __contains__(self, key: object) -> bool:
        return key in self._freq and key not in self._held

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __iter__(self) -> Iterator[bytes]:
        yield from list(self._small)
        yield from list(self._main)

    def add(self, key: bytes) -> None:
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None

    def add_many(self, keys: list[bytes]) -> None:
        for key in keys:
            self.add(key)

    def access(self, key: bytes) -> None:
        self._freq[key] = min(self._freq[key] + 1, self.MAX_FREQ)

    def hold(self, key: bytes) -> None:
        main = key in self._main
        del (self._main if main else self._small)[key]
        self._held[key] = main

    def release(self, key: bytes, use: bool = True) -> None:
        main = self._held.pop(key, None)
        if main is None:
            self.add(key)
            return
        (self._main if main else self._small)[key] = None
        if use:
            self.access(key)

    def rename_held(self, key: bytes, new_key: bytes) -> None:
        self._ghost.pop(new_key, None)
        if key in self._held:  # (a key pinned as it was placed was never added: nothing to rename)
            self._held[new_key] = self._held.pop(key)
            self._freq[new_key] = self._freq.pop(key)

    def rename(self, key: bytes, new_key: bytes) -> None:
        """An unpinned entry takes another key, at the tail of its FIFO with its count."""
        self._ghost.pop(new_key, None)
        fifo = self._main if key in self._main else self._small
        del fifo[key]
        fifo[new_key] = None
        self._freq[new_key] = self._freq.pop(key)

    def discard(self, key: bytes) -> None:
        if key in self._small:
            del self._small[key]
        else:
            del self._main[key]
        del self._freq[key]

    def evict(self, incoming: bytes | None = None) -> bytes | None:
        small, main, freq = self._small, self._main, self._freq
        while small or main:
            if small and (len(small) >= self.small_target or not main):
                key = small.popitem(last=False)[0]
                if freq[key] >= 1:  # used while in the small FIFO: on to the main one
                    freq[key] = 0
                    main[key] = None
                    continue
                del freq[key]
                self._ghost[key] = None
                if len(self._ghost) > self.ghost_size:
                    self._ghost.popitem(last=False)
                return key
            key = main.popitem(last=False)[0]
            if freq[key] > 0:  # used since it last passed the head: once more round
                freq[key] -= 1
                main[key] = None
                continue
            del freq[key]
            return key
        return None

    def check(self) -> None:
        assert set(self._freq) == set(self._small) | set(self._main) | set(self._held), "S3-FIFO counts are off"
        assert not (set(self._small) & set(self._main)), "an entry in both FIFOs"


@register_order
class ARCOrder(EvictionOrder):
    """ARC over ``num_slots`` slots (see the module docstring)."""

    name = ARC

    def __init__(self, num_slots: int) -> None:
        self.c = num_slots
        self.p = 0.0  # T1's target size
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._held: dict[bytes, bool] = {}  # held key -> was it in T2
        self._ghost_hit: set[bytes] = set()  # incoming keys evict() took out of B1/B2 (``p`` adapted), not yet added

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __iter__(self) -> Iterator[bytes]:
        yield from list(self._t1)
        yield from list(self._t2)

    def _take_ghost(self, key: bytes) -> bool:
        """A ghost hit moves ``p`` toward the list that would have kept it, and takes the key
        out of its ghost list (once: a key ``evict`` already took is not counted again)."""
        b1, b2 = len(self._b1), len(self._b2)
        if key in self._b1:
            self.p = min(float(self.c), self.p + max(b2 / b1, 1.0))
            del self._b1[key]
        elif key in self._b2:
            self.p = max(0.0, self.p - max(b1 / b2, 1.0))
            del self._b2[key]
        else:
            return False
        return True

    def add(self, key: bytes) -> None:
        if key in self._ghost_hit:
            self._ghost_hit.discard(key)
            self._t2[key] = None
        elif self._take_ghost(key):
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def add_many(self, keys: list[bytes]) -> None:
        for key in keys:
            self.add(key)

    def _trim_ghosts(self) -> None:
        """|T1| + |B1| <= c and the four lists together <= 2c (ghosts go first)."""
        held = len(self._held)
        while self._b1 and len(self._t1) + len(self._b1) > self.c:
            self._b1.popitem(last=False)
        while (self._b1 or self._b2) and len(self) + held + len(self._b1) + len(self._b2) > 2 * self.c:
            (self._b2 if self._b2 else self._b1).popitem(last=False)

    def access(self, key: bytes) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)

    def hold(self, key: bytes) -> None:
        in_t2 = key in self._t2
        del (self._t2 if in_t2 else self._t1)[key]
        self._held[key] = in_t2

    def release(self, key: bytes, use: bool = True) -> None:
        in_t2 = self._held.pop(key, None)
        if in_t2 is None:
            self.add(key)
        else:
            (self._t2 if use or in_t2 else self._t1)[key] = None  # a use moves it to T2

    def rename_held(self, key: bytes, new_key: bytes) -> None:
        self._b1.pop(new_key, None)
        self._b2.pop(new_key, None)
        if key in self._held:  # (a key pinned as it was placed was never added: nothing to rename)
            self._held[new_key] = self._held.pop(key)
        if key in self._ghost_hit:
            self._ghost_hit.discard(key)
            self._ghost_hit.add(new_key)

    def rename(self, key: bytes, new_key: bytes) -> None:
        """An unpinned entry takes another key, in its list at the most recent end."""
        self._b1.pop(new_key, None)
        self._b2.pop(new_key, None)
        in_t2 = key in self._t2
        del (self._t2 if in_t2 else self._t1)[key]
        (self._t2 if in_t2 else self._t1)[new_key] = None

    def discard(self, key: bytes) -> None:
        if key in self._t1:
            del self._t1[key]
        else:
            del self._t2[key]

    def evict(self, incoming: bytes | None = None) -> bytes | None:
        """ARC's REPLACE: T1's least recent when T1 is over its target (or at it, for a key
        ARC remembers from T2), else T2's; the victim's key goes to its list's ghost."""
        t1, t2 = self._t1, self._t2
        if not t1 and not t2:
            return None
        in_b2 = incoming is not None and incoming in self._b2
        if incoming is not None and incoming not in self._ghost_hit and self._take_ghost(incoming):
            self._ghost_hit.add(incoming)
        if t1 and (len(t1) > self.p or (in_b2 and len(t1) == int(self.p)) or not t2):
            key = t1.popitem(last=False)[0]
            self._b1[key] = None
        else:
            key = t2.popitem(last=False)[0]
            self._b2[key] = None
        self._trim_ghosts()
        return key

    def check(self) -> None:
        lists = [set(self._t1), set(self._t2), set(self._b1), set(self._b2), set(self._held), self._ghost_hit]
        assert sum(map(len, lists)) == len(set().union(*lists)), "a key in two ARC lists"


def make_order(value: str, num_slots: int, where: str = "eviction",
               context: OrderContext | None = None) -> EvictionOrder:
    """The eviction order ``value`` names (a tier's ``eviction``: a registered order's name, or
    ``cost:<alpha>``) over ``num_slots`` slots, weighing blocks by what it needs of ``context``
    (the policy's; by default a context of its own, where a ``cost`` order weighs every block
    alike). An unknown name is a :class:`ConfigError` naming ``where`` and the registered names."""
    value = check_eviction(value, where)
    cls = order_class(eviction_name(value), where)
    return cls.create(num_slots, value, context if context is not None else OrderContext())
