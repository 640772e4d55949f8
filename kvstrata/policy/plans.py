"""Plans: what the tier policy hands to an executor. Plain, picklable values.

A plan names device blocks (rows of kvstrata's pool, or vLLM block ids), CPU
slab slots and SSD keys; it never holds bytes. The vLLM connector sends the
same objects from its scheduler half to its workers as connector metadata.

Execution order inside one plan (the executor's contract):

1. ``spills``: ``(cpu slot, key)`` pairs whose bytes are copied from the slab
   to the SSD tier: the policy evicted those keys from the CPU tier to make
   room, and the slot is rewritten by this plan or a later one;
2. ``ssd_evictions``: keys the policy evicted from the SSD tier;
3. the plan's own copies.

Every slot a plan reads or writes stays pinned in the policy until the plan
is completed, so no plan evicts or reuses a slot another open plan uses. Plans
may still depend on earlier ones: a load may read a CPU slot that an earlier
load promotes into, or a key an earlier plan deleted from the SSD tier may be
written again by a later one. Executors therefore run plans in the order the
policy prepared them (loads on one first-in-first-out thread).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from kvstrata.policy.tiers import CPU, REMOTE, SSD

__all__ = ["LoadPlan", "StorePlan", "FetchPlan", "COMPUTED", "PAGEOUT", "EVICTED", "SHUTDOWN", "STORE_REASONS"]

#: Why blocks are offered for storing (admission decides which reasons it takes).
COMPUTED = "computed"   # blocks became full and their KV was written
PAGEOUT = "pageout"     # the least recently used free device blocks (the page-out window)
EVICTED = "evicted"     # the device pool took these blocks for reuse; rows intact until rewritten
SHUTDOWN = "shutdown"   # a graceful close: device-resident blocks the persistent tier lacks
STORE_REASONS = (COMPUTED, PAGEOUT, EVICTED, SHUTDOWN)


@dataclass
class LoadPlan:
    """Copy a request's blocks held below into its device blocks (parallel lists, prefix order).

    ``cpu_slots[i] >= 0``: read from that slab slot. Otherwise ``from_ssd[i]``:
    read from the SSD tier, and when ``promote_slots[i] >= 0`` also write the
    block into that slab slot. Neither: the policy no longer holds the block
    (the load of it and of every later block fails).
    """

    plan_id: int
    req_id: str
    block_ids: list[int]
    keys: list[bytes]
    cpu_slots: list[int]
    from_ssd: list[bool]
    promote_slots: list[int]
    spills: list[tuple[int, bytes]] = field(default_factory=list)
    ssd_evictions: list[bytes] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.keys)

    def placed(self, done: int | None = None) -> list[tuple[str, bytes]]:
        """``(tier, key)`` this plan's run wrote when its first ``done`` blocks arrived (all
        when None): the promotions among them, and every spill."""
        n = len(self.keys) if done is None else done
        out = [(CPU, k) for k, s in zip(self.keys[:n], self.promote_slots[:n]) if s >= 0]
        return out + [(SSD, k) for _, k in self.spills]

    def tiers(self) -> list[str]:
        """Where each block comes from: the slab tier, the persistent tier or ``""`` (not held)."""
        return [CPU if s >= 0 else SSD if f else "" for s, f in zip(self.cpu_slots, self.from_ssd)]

    def loaded(self, lost: Iterable[tuple[str, bytes]] = ()) -> int:
        """How many blocks, from the first, a run of this plan delivers: up to the first
        one held nowhere or named in ``lost`` (``(tier, key)`` the executor could not read)."""
        failed = {key for _, key in lost}
        for i, (key, slot, from_ssd) in enumerate(zip(self.keys, self.cpu_slots, self.from_ssd)):
            if (slot < 0 and not from_ssd) or key in failed:
                return i
        return len(self.keys)


@dataclass
class StorePlan:
    """Copy device blocks down (parallel lists): into slab slot ``cpu_slots[i]`` when
    ``>= 0``, to the SSD tier when ``to_ssd[i]``, and to the remote tier when
    ``to_remote[i]`` (empty: none). ``ssd_touches``: keys the SSD tier holds whose
    recency to refresh, least recently used first (a shutdown's hot set)."""

    plan_id: int
    reason: str
    block_ids: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    cpu_slots: list[int] = field(default_factory=list)
    to_ssd: list[bool] = field(default_factory=list)
    spills: list[tuple[int, bytes]] = field(default_factory=list)
    ssd_evictions: list[bytes] = field(default_factory=list)
    ssd_touches: list[bytes] = field(default_factory=list)
    to_remote: list[bool] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, block_id: int, key: bytes, slot: int, to_ssd: bool, to_remote: bool = False) -> None:
        if to_remote and not self.to_remote:
            self.to_remote = [False] * len(self.keys)
        if self.to_remote:
            self.to_remote.append(to_remote)
        self.block_ids.append(block_id)
        self.keys.append(key)
        self.cpu_slots.append(slot)
        self.to_ssd.append(to_ssd)

    def remote(self, i: int) -> bool:
        """Does block ``i`` go to the remote tier?"""
        return bool(self.to_remote) and self.to_remote[i]

    def placed(self, done: int | None = None) -> list[tuple[str, bytes]]:
        """``(tier, key)`` this plan writes: its blocks where they go, and every spill (a store
        completes as a whole: ``done`` is accepted for the plans' one signature)."""
        out = [(CPU, k) for k, s in zip(self.keys, self.cpu_slots) if s >= 0]
        out += [(SSD, k) for k, s in zip(self.keys, self.to_ssd) if s]
        out += [(SSD, k) for _, k in self.spills]
        return out + [(REMOTE, k) for i, k in enumerate(self.keys) if self.remote(i)]

    @property
    def empty(self) -> bool:
        return not (self.keys or self.spills or self.ssd_evictions or self.ssd_touches)


@dataclass
class FetchPlan:
    """Copy blocks from the remote tier into pinned slab slots (parallel lists, prefix
    order), and to the SSD tier when ``to_ssd[i]``. A block that does not arrive (missing,
    late, corrupt) ends the fetch: it and every later one are reported not fetched. Only
    then are the fetched blocks CPU hits: the engine is never told of a remote block whose
    bytes are not local."""

    plan_id: int
    keys: list[bytes] = field(default_factory=list)
    cpu_slots: list[int] = field(default_factory=list)
    to_ssd: list[bool] = field(default_factory=list)
    spills: list[tuple[int, bytes]] = field(default_factory=list)
    ssd_evictions: list[bytes] = field(default_factory=list)
    req_id: str = ""  # the request it was fetched for (a driver's bookkeeping)

    def __len__(self) -> int:
        return len(self.keys)

    def placed(self, done: int | None = None) -> list[tuple[str, bytes]]:
        """``(tier, key)`` this plan's run wrote when its first ``done`` blocks arrived (all when None)."""
        n = len(self.keys) if done is None else done
        out = [(CPU, k) for k in self.keys[:n]]
        out += [(SSD, k) for k, s in zip(self.keys[:n], self.to_ssd[:n]) if s]
        return out + [(SSD, k) for _, k in self.spills]
