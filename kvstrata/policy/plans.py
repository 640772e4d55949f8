"""Plans: what the tier policy hands to an executor. Plain, picklable values.

A plan names device blocks (rows of kvstrata's pool, or vLLM block ids), slab
slots and keys; it never holds bytes. The vLLM connector sends the same objects
from its scheduler half to its workers as connector metadata. Every operation
below the slab names its tier by the tier's declared name: a plan keeps one
operation list per tier (``writes``, ``evictions``, ``touches``), never one
field per role.

Execution order inside one plan (the executor's contract):

1. ``evictions``: per tier, keys the policy evicted from it;
2. ``spills``: :class:`Spill` copies of blocks the policy evicted from one tier
   down to the tier it cascades to (a slab slot, rewritten by this plan or a
   later one, or a key-addressed record);
3. the plan's own copies.

Every slot a plan reads or writes stays pinned in the policy until the plan
is completed, so no plan evicts or reuses a slot another open plan uses. Plans
may still depend on earlier ones: a load may read a slab slot that an earlier
load promotes into, or a key an earlier plan deleted from a tier may be
written again by a later one. Executors therefore run plans in the order the
policy prepared them (loads on one first-in-first-out thread).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

__all__ = ["Spill", "LoadPlan", "StorePlan", "FetchPlan", "COMPUTED", "PAGEOUT", "EVICTED", "SHUTDOWN",
           "STORE_REASONS"]

#: Why blocks are offered for storing (admission decides which reasons it takes).
COMPUTED = "computed"   # blocks became full and their KV was written
PAGEOUT = "pageout"     # the least recently used free device blocks (the page-out window)
EVICTED = "evicted"     # the device pool took these blocks for reuse; rows intact until rewritten
SHUTDOWN = "shutdown"   # a graceful close: device-resident blocks the persistent tier lacks
STORE_REASONS = (COMPUTED, PAGEOUT, EVICTED, SHUTDOWN)


class Spill(NamedTuple):
    """Copy block ``key`` from tier ``src`` (slab slot ``slot``; -1: a key-addressed tier)
    down to tier ``dst``: the policy evicted it from ``src`` and it cascades."""

    src: str
    slot: int
    dst: str
    key: bytes


def _written(keys: list[bytes], writes: dict[str, list[int]], n: int) -> list[tuple[str, bytes]]:
    """``(tier, key)`` of the ``writes`` among the first ``n`` blocks."""
    return [(tier, keys[i]) for tier, idx in writes.items() for i in idx if i < n]


@dataclass
class LoadPlan:
    """Copy a request's blocks held below into its device blocks (parallel lists, prefix order).

    ``sources[i]``: the tier block ``i`` is read from (``""``: the policy no longer holds it;
    the load of it and of every later block fails). ``slots[i] >= 0``: it is read from that
    slab slot; otherwise from its key-addressed tier, and when ``promote_slots[i] >= 0`` it
    is also written into that slab slot.
    """

    plan_id: int
    req_id: str
    block_ids: list[int]
    keys: list[bytes]
    slots: list[int]
    sources: list[str]
    promote_slots: list[int]
    spills: list[Spill] = field(default_factory=list)
    evictions: dict[str, list[bytes]] = field(default_factory=dict)
    slab: str = field(default="", compare=False)  # the slab tier's name (the deployment's, not the plan's)

    def __len__(self) -> int:
        return len(self.keys)

    def placed(self, done: int | None = None) -> list[tuple[str, bytes]]:
        """``(tier, key)`` this plan's run wrote when its first ``done`` blocks arrived (all
        when None): the promotions among them, and every spill."""
        n = len(self.keys) if done is None else done
        out = [(self.slab, k) for k, s in zip(self.keys[:n], self.promote_slots[:n]) if s >= 0]
        return out + [(s.dst, s.key) for s in self.spills]

    def tiers(self) -> list[str]:
        """Where each block comes from (``""``: not held)."""
        return list(self.sources)

    def keyed(self) -> list[int]:
        """The blocks read from a key-addressed tier (not from a slab slot)."""
        return [i for i, (t, s) in enumerate(zip(self.sources, self.slots)) if t and s < 0]

    def loaded(self, lost: Iterable[tuple[str, bytes]] = ()) -> int:
        """How many blocks, from the first, a run of this plan delivers: up to the first
        one held nowhere or named in ``lost`` (``(tier, key)`` the executor could not read)."""
        failed = {key for _, key in lost}
        for i, (key, source) in enumerate(zip(self.keys, self.sources)):
            if not source or key in failed:
                return i
        return len(self.keys)


@dataclass
class StorePlan:
    """Copy device blocks down (parallel lists): into slab slot ``slots[i]`` when ``>= 0``,
    and to each key-addressed tier ``t`` for the blocks ``writes[t]`` lists (indices into
    the plan). ``touches``: per tier, keys it holds whose recency to refresh, least recently
    used first (a shutdown's hot set)."""

    plan_id: int
    reason: str
    block_ids: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    writes: dict[str, list[int]] = field(default_factory=dict)
    spills: list[Spill] = field(default_factory=list)
    evictions: dict[str, list[bytes]] = field(default_factory=dict)
    touches: dict[str, list[bytes]] = field(default_factory=dict)
    slab: str = field(default="", compare=False)  # the slab tier's name (the deployment's, not the plan's)

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, block_id: int, key: bytes, slot: int, to: Iterable[str] = ()) -> None:
        """One more block: into slab ``slot`` (-1: none) and to each tier of ``to``."""
        for tier in to:
            self.writes.setdefault(tier, []).append(len(self.keys))
        self.block_ids.append(block_id)
        self.keys.append(key)
        self.slots.append(slot)

    def goes_to(self, tier: str) -> list[int]:
        """The blocks this plan writes to ``tier`` (indices)."""
        return self.writes.get(tier, [])

    def placed(self, done: int | None = None) -> list[tuple[str, bytes]]:
        """``(tier, key)`` this plan writes: its blocks where they go, and every spill (a store
        completes as a whole: ``done`` is accepted for the plans' one signature)."""
        out = [(self.slab, k) for k, s in zip(self.keys, self.slots) if s >= 0]
        out += _written(self.keys, self.writes, len(self.keys))
        return out + [(s.dst, s.key) for s in self.spills]

    @property
    def empty(self) -> bool:
        return not (self.keys or self.spills or self.evictions or self.touches)


@dataclass
class FetchPlan:
    """Copy blocks from the shared tier ``source`` into pinned slab slots (parallel lists,
    prefix order), and to each key-addressed tier ``t`` for the blocks ``writes[t]`` lists. A
    block that does not arrive (missing, late, corrupt) ends the fetch: it and every later
    one are reported not fetched. Only then are the fetched blocks slab hits: the engine is
    never told of a remote block whose bytes are not local."""

    plan_id: int
    keys: list[bytes] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    writes: dict[str, list[int]] = field(default_factory=dict)
    spills: list[Spill] = field(default_factory=list)
    evictions: dict[str, list[bytes]] = field(default_factory=dict)
    req_id: str = ""  # the request it was fetched for (a driver's bookkeeping)
    source: str = field(default="", compare=False)  # the shared tier it reads
    slab: str = field(default="", compare=False)    # the slab tier it lands in

    def __len__(self) -> int:
        return len(self.keys)

    def placed(self, done: int | None = None) -> list[tuple[str, bytes]]:
        """``(tier, key)`` this plan's run wrote when its first ``done`` blocks arrived (all when None)."""
        n = len(self.keys) if done is None else done
        out = [(self.slab, k) for k in self.keys[:n]]
        out += _written(self.keys, self.writes, n)
        return out + [(s.dst, s.key) for s in self.spills]
