"""The ``cost`` eviction order: recency plus what a block saves, in the manner of Marconi.

Marconi (Pan et al., MLSys'25) evicts the entry of the lowest

    score = recency + alpha x efficiency

both normalised to [0, 1] over the entries present: recency by the time of
last use between the oldest (0) and now (1), efficiency as FLOPs saved per
byte against the most efficient entry. For a block of a prefix cache the
efficiency is the weight ``w`` of its reach (:mod:`kvstrata.policy.positions`: a
later block attends a longer context, so recomputing it costs more; every block
of a tier has the same bytes; and a block is weighed as the deepest block of the
last prompt that held it, since a prefix hit needs every block before it).
``alpha = 0`` is LRU exactly; a larger ``alpha`` keeps the blocks of long
prompts longer at the expense of recency.

O(1) per operation: entries sit in :data:`~kvstrata.policy.positions.CLASSES`
LRU lists, one per weight class (a quarter octave of ``w``). Within a class the
least recently used has the lowest score (their efficiencies are within 19% of
each other and are taken as the class's lower bound), so the victim is the
lowest-scoring head of at most ``CLASSES`` lists. Ties go to the cheaper class.

``alpha`` is a tier's ``eviction: cost:<alpha>`` (``cost`` alone: 0.5). Marconi
tunes it by replaying recent traffic; ``kvstrata bench --compare`` does so for
its ``cost`` rows (the first quarter of the trace, a grid of weights) and names
the weight it chose in the row's ``set``.

The reaches come from the policy's :class:`~kvstrata.policy.orders.OrderContext` (its book,
which the driver teaches and every tier's ``cost`` order shares).

A hold keeps a key's class; a release, like a use, puts it at the most recent
end of its class's list. A key whose reach was unknown when it came has its
class looked up again at each use (a lookup may have taught the book meanwhile);
a known one keeps its class.

Threading: owned by the index's owner thread.
"""

from __future__ import annotations

from bisect import insort
from collections import OrderedDict
from heapq import merge
from operator import itemgetter
from typing import Iterator

from kvstrata.policy.orders import EvictionOrder, OrderContext, register_order
from kvstrata.policy.positions import CLASSES, Positions
from kvstrata.system.values import COST, COST_ALPHA, eviction_alpha

__all__ = ["CostOrder"]

_EFFICIENCY = [2.0 ** (-d / 4) for d in range(CLASSES)]  # a class d quarter octaves below the top one


def _tick_of(head: tuple[int, tuple[bytes, int]]) -> int:
    return head[1][1]


@register_order
class CostOrder(EvictionOrder):
    """Recency + ``alpha`` x efficiency over weight classes (see the module docstring)."""

    name = COST

    @classmethod
    def create(cls, num_slots: int, value: str, context: OrderContext) -> "CostOrder":
        """``cost`` (alpha :data:`~kvstrata.system.values.COST_ALPHA`) or ``cost:<alpha>``, over the
        context's book of reaches."""
        alpha = eviction_alpha(value)
        return cls(context.reaches(), COST_ALPHA if alpha is None else alpha)

    def __init__(self, positions: Positions, alpha: float) -> None:
        self.positions = positions
        self.alpha = float(alpha)
        self._lists: list[OrderedDict[bytes, int]] = [OrderedDict() for _ in range(CLASSES)]
        # key -> its class and reach, as (reach + 1) x CLASSES + class (reach -1: unknown)
        self._class: dict[bytes, int] = {}  # unpinned keys
        self._held: dict[bytes, int] = {}
        self._live: list[int] = []  # the classes whose lists are not empty, in order
        self._tick = 0

    def __contains__(self, key: object) -> bool:
        return key in self._class

    def __len__(self) -> int:
        return len(self._class)

    def __iter__(self) -> Iterator[bytes]:
        """Least recently used first across the classes (the order ``alpha = 0`` evicts in)."""
        return iter([k for k, _ in merge(*(lst.items() for lst in self._lists if lst), key=itemgetter(1))])

    def _put(self, key: bytes, entry: int) -> None:
        self._tick += 1
        lst = self._lists[entry % CLASSES]
        lst[key] = self._tick
        self._class[key] = entry
        if len(lst) == 1:
            insort(self._live, entry % CLASSES)

    def _drop(self, klass: int, key: bytes) -> None:
        lst = self._lists[klass]
        del lst[key]
        if not lst:
            self._live.remove(klass)

    def _entry(self, key: bytes) -> int:
        klass, position = self.positions.klass(key)
        return (position + 1) * CLASSES + klass

    def add(self, key: bytes) -> None:
        self._put(key, self._entry(key))

    def add_many(self, keys: list[bytes]) -> None:
        for key in keys:
            self._put(key, self._entry(key))

    def access(self, key: bytes) -> None:
        entry = self._class[key]
        if entry >= CLASSES:  # its reach is known: its class stays
            lst = self._lists[entry % CLASSES]
            lst.move_to_end(key)
            self._tick += 1
            lst[key] = self._tick
            return
        self._drop(entry, key)
        self._put(key, self._entry(key))

    def hold(self, key: bytes) -> None:
        entry = self._class.pop(key)
        self._drop(entry % CLASSES, key)
        self._held[key] = entry

    def release(self, key: bytes, use: bool = True) -> None:
        entry = self._held.pop(key, None)
        self._put(key, self._entry(key) if entry is None or use else entry)

    def rename_held(self, key: bytes, new_key: bytes) -> None:
        if key in self._held:  # (a key pinned as it was placed was never added: nothing to rename)
            self._held[new_key] = self._held.pop(key)

    def rename(self, key: bytes, new_key: bytes) -> None:
        """An unpinned entry takes another key, in its class at the most recent end."""
        entry = self._class.pop(key)
        self._drop(entry % CLASSES, key)
        self._put(new_key, entry)

    def discard(self, key: bytes) -> None:
        self._drop(self._class.pop(key) % CLASSES, key)

    def evict(self, incoming: bytes | None = None) -> bytes | None:
        if not self._live:
            return None
        lists = self._lists
        heads = [(c, next(iter(lists[c].items()))) for c in self._live]
        klass, (key, oldest) = min(heads, key=_tick_of)
        if self.alpha and len(heads) > 1:
            span = float(self._tick - oldest) or 1.0
            top, alpha = heads[-1][0], self.alpha
            klass, (key, _) = min(heads, key=lambda h: ((h[1][1] - oldest) / span + alpha * _EFFICIENCY[top - h[0]],
                                                        h[0]))
        self._drop(klass, key)
        reach = self._class.pop(key) // CLASSES - 1
        if reach >= 0:
            self.positions.keep(key, reach)  # for the tier the eviction cascades to
        return key

    def check(self) -> None:
        listed = {k: c for c, lst in enumerate(self._lists) for k in lst}
        assert listed == {k: e % CLASSES for k, e in self._class.items()}, "cost order: the classes and the lists disagree"
        assert not (self._class.keys() & self._held.keys()), "cost order: a key both held and unpinned"
        assert self._live == [c for c, lst in enumerate(self._lists) if lst], "cost order: the live classes are off"
