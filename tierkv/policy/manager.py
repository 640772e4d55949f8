"""The tier policy: which lower tier holds each block, and what moves when.

One bytes-free object decides placement for every driver: the library's
:class:`tierkv.tiered.TieredKVCache`, the vLLM connector's scheduler half and
the ``tierkv bench`` replay. Drivers report facts (a prompt's blocks, blocks
that were computed, evicted or are about to be) and apply the plans they get
back through an executor; they decide nothing themselves.

Verbs (in the manner of vLLM's ``OffloadingManager``):

* :meth:`lookup`: the tiers of the longest prefix of keys held below. Pure:
  no I/O, no pins, no recency change.
* :meth:`touch`: mark keys recently used (a device-pool hit on them).
* :meth:`prepare_load` / :meth:`complete_load`: pin the sources of a load,
  place promotions; release them once the copies finished.
* :meth:`prepare_store` / :meth:`complete_store`: admission, placement,
  cascade and evictions for blocks offered for a reason (see
  :mod:`tierkv.policy.plans`); release once written.
* :meth:`forget`: an executor found blocks missing or corrupt.
* :meth:`take_events`: the recorded :class:`~tierkv.policy.events.PolicyEvent`
  batches, when ``record_events`` is on.

Lifetime rules: every slot a plan reads or writes (load sources, promotion
slots, store targets, cascade targets) is pinned from ``prepare_*`` until
``complete_*``; a pinned key is never evicted, so plans prepared in one step
never touch each other's slots, and an executor may run them in any order
that keeps each plan's own order (see :mod:`tierkv.policy.plans`). A key
forgotten while pinned leaves when its last pin goes.

Threading: not thread-safe. One owner thread (an engine's scheduler thread)
calls every verb; executors run elsewhere and report back through that thread.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Sequence

from tierkv.policy.events import EventCounts, Observer, PolicyEvent
from tierkv.policy.plans import COMPUTED, SHUTDOWN, LoadPlan, StorePlan
from tierkv.policy.slot_index import SlotIndex
from tierkv.policy.spec import PolicySpec

__all__ = ["TierPolicy", "select_for_shutdown"]


def select_for_shutdown(offered_mru_first: Iterable[tuple[int, bytes]], persisted: Callable[[bytes], bool],
                        limit: int) -> list[tuple[int, bytes]]:
    """The shutdown rule: of the device blocks offered most recently used first, the
    ``limit`` most recent that the persistent tier lacks, returned least recently used
    first (so that the most recent end up most recent there too)."""
    chosen: list[tuple[int, bytes]] = []
    seen: set[bytes] = set()
    for block, key in offered_mru_first:
        if len(chosen) >= limit:
            break
        if key not in seen and not persisted(key):
            seen.add(key)
            chosen.append((block, key))
    chosen.reverse()
    return chosen


class TierPolicy:
    """Placement over a CPU tier and an SSD tier, sized and ruled by a :class:`PolicySpec`."""

    def __init__(self, spec: PolicySpec, *, clock: Callable[[], float] = time.monotonic,
                 observers: Iterable[Observer] = (), record_events: bool = False) -> None:
        self.spec = spec
        self.clock = clock
        self.cpu: SlotIndex | None = SlotIndex(spec.cpu_slots) if spec.cpu_slots else None
        self.ssd: SlotIndex | None = SlotIndex(spec.ssd_slots) if spec.ssd_slots else None
        self.counts = EventCounts()
        self._observers: list[Observer] = [self.counts, *observers]
        self._events: list[PolicyEvent] | None = [] if record_events else None
        self._pins: dict[int, list[tuple[SlotIndex, bytes]]] = {}
        self._doomed: dict[int, set[bytes]] = {}   # id(index) -> keys to drop at their last unpin
        self._next_plan = 0

    # ------------------------------------------------------------------ queries

    def lookup(self, keys: Sequence[bytes]) -> list[str]:
        """``cpu`` or ``ssd`` for each key of the longest prefix of ``keys`` held below.
        Pure: nothing is pinned, touched or counted."""
        cpu = self.cpu._slot if self.cpu is not None else {}
        ssd = self.ssd._slot if self.ssd is not None else {}
        out: list[str] = []
        for key in keys:
            if key in cpu:
                out.append("cpu")
            elif key in ssd:
                out.append("ssd")
            else:
                break
        return out

    def holds(self, key: bytes) -> str | None:
        """The highest lower tier holding ``key`` (``cpu``/``ssd``), or None."""
        if self.cpu is not None and key in self.cpu:
            return "cpu"
        if self.ssd is not None and key in self.ssd:
            return "ssd"
        return None

    @property
    def pageout_blocks(self) -> int:
        """How many least recently used free device blocks a driver offers for page-out."""
        return self.spec.pageout_blocks

    def admits(self, reason: str) -> bool:
        return self.spec.admits(reason)

    def occupancy(self) -> dict[str, int]:
        return {"cpu": len(self.cpu) if self.cpu is not None else 0,
                "ssd": len(self.ssd) if self.ssd is not None else 0}

    def capacity(self) -> dict[str, int]:
        return {"cpu": self.spec.cpu_slots, "ssd": self.spec.ssd_slots}

    def pinned(self) -> dict[str, int]:
        return {"cpu": self.cpu.num_pinned if self.cpu is not None else 0,
                "ssd": self.ssd.num_pinned if self.ssd is not None else 0}

    # ------------------------------------------------------------------ recency

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark ``keys`` recently used in every lower tier holding them."""
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        for index in (self.cpu, self.ssd):
            if index is not None:
                index.touch_many(keys)

    def seed_ssd(self, keys_lru_first: Iterable[bytes]) -> list[bytes]:
        """Start from what the persistent tier already holds (least recently used first).

        Returns the keys that do not fit the configured capacity (the oldest):
        the caller deletes them from the tier. Emits no events.
        """
        if self.ssd is None:
            return list(keys_lru_first)
        keys = [k for k in dict.fromkeys(keys_lru_first) if k not in self.ssd]
        _, evicted = self.ssd.allocate_many(keys)
        return [k for k, _ in evicted]

    # ------------------------------------------------------------------ loads

    def prepare_load(self, req_id: str, keys: Sequence[bytes], block_ids: Sequence[int]) -> LoadPlan:
        """Plan copying ``keys`` (a prefix :meth:`lookup` found below) into ``block_ids``.

        Pins every source, and (inclusive promotion) gives SSD hits a CPU slot,
        pinned too, evicting and cascading as a store would.
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"block_ids: expected {len(keys)} blocks (one per key), got {len(block_ids)}")
        plan = LoadPlan(self._plan_id(), req_id, list(block_ids), list(keys), [], [], [-1] * len(keys))
        pins = self._pins[plan.plan_id] = []
        cpu, ssd = self.cpu, self.ssd
        from_cpu: list[bytes] = []
        from_ssd: list[bytes] = []
        for key in plan.keys:
            if cpu is not None and key in cpu:
                plan.cpu_slots.append(cpu.pin(key))
                plan.from_ssd.append(False)
                pins.append((cpu, key))
                from_cpu.append(key)
            else:
                held = ssd is not None and key in ssd
                if held:
                    ssd.pin(key)  # type: ignore[union-attr]
                    pins.append((ssd, key))  # type: ignore[arg-type]
                    from_ssd.append(key)
                plan.cpu_slots.append(-1)
                plan.from_ssd.append(held)
        now = self.clock()
        self._emit("hit", "cpu", from_cpu, now)
        self._emit("hit", "ssd", from_ssd, now)
        if from_ssd and cpu is not None and self.spec.promotion == "inclusive":
            self._promote(plan, from_ssd, now)
        return plan

    def _promote(self, plan: LoadPlan, keys: list[bytes], now: float) -> None:
        """Give SSD hits pinned CPU slots (promote_slots), cascading what that evicts."""
        assert self.cpu is not None
        slots, evicted = self.cpu.allocate_many(keys)
        self._cascade(plan, evicted, now)
        placed = {}
        for key, slot in zip(keys, slots):
            if slot is not None:
                self.cpu.pin(key)
                self._pins[plan.plan_id].append((self.cpu, key))
                placed[key] = slot
        plan.promote_slots = [placed.get(k, -1) if s else -1 for k, s in zip(plan.keys, plan.from_ssd)]
        self._emit("stored", "cpu", list(placed), now)
        self._emit("dropped", "cpu", [k for k in keys if k not in placed], now)

    def complete_load(self, plan: LoadPlan, lost: Iterable[tuple[str, bytes]] = ()) -> None:
        """The load finished: release its pins. ``lost``: ``(tier, key)`` the executor
        could not read (forgotten). Exclusive promotion moves loaded CPU blocks up."""
        self._release(plan.plan_id)
        lost = list(lost)
        self.forget_pairs(lost)
        if self.spec.promotion == "exclusive" and self.cpu is not None:
            failed = {k for t, k in lost if t == "cpu"}
            moved = [k for k, s in zip(plan.keys, plan.cpu_slots) if s >= 0 and k not in failed]
            self._drop_keys(self.cpu, "cpu", moved)

    # ------------------------------------------------------------------ stores

    def prepare_store(self, block_ids: Sequence[int], keys: Sequence[bytes], reason: str) -> StorePlan:
        """Offer device blocks for storing; returns the plan admission and placement made.

        ``computed`` blocks a tier already holds are touched there; ``pageout``
        and ``evicted`` blocks that any lower tier holds are skipped. The others
        get a CPU slot (evicting the least recently used, which cascades to the
        SSD tier without write-through). With write-through, or when the CPU tier
        has no room, blocks the SSD tier lacks go there. ``shutdown`` offers
        device blocks most recently used first: the most recent that fit go to
        the SSD tier.
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"block_ids: expected {len(keys)} blocks (one per key), got {len(block_ids)}")
        plan = StorePlan(self._plan_id(), reason)
        self._pins[plan.plan_id] = []
        if not self.spec.admits(reason) or not self.spec.has_lower_tier:
            return plan
        if reason == SHUTDOWN:
            self._plan_shutdown(plan, block_ids, keys)
        else:
            self._plan_store(plan, block_ids, keys, reason)
        return plan

    def _plan_store(self, plan: StorePlan, block_ids: Sequence[int], keys: Sequence[bytes], reason: str) -> None:
        now = self.clock()
        cpu, ssd = self.cpu, self.ssd
        cpu_keys = cpu._slot if cpu is not None else {}
        ssd_keys = ssd._slot if ssd is not None else {}
        offered = dict(zip(keys, block_ids))  # a repeated key is stored once
        if reason == COMPUTED:  # a recomputed block is a use of the copies below
            present = [k for k in offered if k in cpu_keys]
            if cpu is not None:
                cpu.touch_many(present)
            if ssd is not None:
                ssd.touch_many([k for k in offered if k in ssd_keys])
        else:  # paged out or evicted: only blocks no lower tier holds go down, nothing is touched
            offered = {k: b for k, b in offered.items() if k not in cpu_keys and k not in ssd_keys}
            present = []
        new = [k for k in offered if k not in cpu_keys] if cpu is not None else []
        slots = self._place_cpu(plan, new, now) if new else {}
        to_ssd = self._ssd_wanted(offered, slots, set(present))
        placed_ssd = self._place_ssd(plan, to_ssd, now) if to_ssd else set()
        for key, block in offered.items():
            slot = slots.get(key, -1)
            if slot >= 0 or key in placed_ssd:
                plan.add(block, key, slot, key in placed_ssd)
        nowhere = [k for k in new if k not in slots and k not in placed_ssd and k not in ssd_keys]
        self._emit("dropped", "cpu", nowhere, now)

    def _ssd_wanted(self, offered: dict[bytes, int], cpu_slots: dict[bytes, int], in_cpu: set[bytes]) -> list[bytes]:
        """Keys that go to the SSD tier: all it lacks with write-through, else those
        the CPU tier could not take."""
        ssd = self.ssd
        if ssd is None:
            return []
        if self.spec.write_through or self.cpu is None:
            return [k for k in offered if k not in ssd._slot]
        return [k for k in offered if k not in ssd._slot and k not in cpu_slots and k not in in_cpu]

    def _plan_shutdown(self, plan: StorePlan, block_ids: Sequence[int], keys: Sequence[bytes]) -> None:
        ssd = self.ssd
        if ssd is None:
            return
        chosen = select_for_shutdown(zip(block_ids, keys), ssd._slot.__contains__, ssd.num_slots - ssd.num_pinned)
        placed = self._place_ssd(plan, [k for _, k in chosen], self.clock())
        for block, key in chosen:
            if key in placed:
                plan.add(block, key, -1, True)

    def complete_store(self, plan: StorePlan, lost: Iterable[tuple[str, bytes]] = ()) -> None:
        """The plan's copies finished: release its pins; forget ``(tier, key)`` that failed."""
        self._release(plan.plan_id)
        self.forget_pairs(lost)

    # ------------------------------------------------------------------ placement

    def _place_cpu(self, plan: StorePlan | LoadPlan, keys: list[bytes], now: float) -> dict[bytes, int]:
        """CPU slots for absent ``keys`` (pinned for the plan); cascades what they evict."""
        assert self.cpu is not None
        slots, evicted = self.cpu.allocate_many(keys)
        self._cascade(plan, evicted, now)
        placed = {k: s for k, s in zip(keys, slots) if s is not None}
        pins = self._pins[plan.plan_id]
        for key in placed:
            self.cpu.pin(key)
            pins.append((self.cpu, key))
        self._emit("stored", "cpu", list(placed), now)
        return placed

    def _place_ssd(self, plan: StorePlan | LoadPlan, keys: list[bytes], now: float) -> set[bytes]:
        """Place absent ``keys`` in the SSD tier (pinned for the plan); evictions go in the plan."""
        assert self.ssd is not None
        slots, evicted = self.ssd.allocate_many(keys)
        gone = [k for k, _ in evicted]
        plan.ssd_evictions.extend(gone)
        self._emit("evicted", "ssd", gone, now)
        placed = [k for k, s in zip(keys, slots) if s is not None]
        pins = self._pins[plan.plan_id]
        for key in placed:
            self.ssd.pin(key)
            pins.append((self.ssd, key))
        self._emit("stored", "ssd", placed, now)
        self._emit("dropped", "ssd", [k for k, s in zip(keys, slots) if s is None], now)
        return set(placed)

    def _cascade(self, plan: StorePlan | LoadPlan, evicted: list[tuple[bytes, int]], now: float) -> None:
        """Keys the CPU tier evicted: without write-through they go down to the SSD tier
        (a spill: slab slot -> SSD, executed before the slot is rewritten)."""
        if not evicted:
            return
        self._emit("evicted", "cpu", [k for k, _ in evicted], now)
        ssd = self.ssd
        if ssd is None or self.spec.write_through:
            return
        down = [(k, s) for k, s in evicted if k not in ssd._slot]
        if not down:
            return
        placed = self._place_ssd(plan, [k for k, _ in down], now)
        plan.spills.extend((s, k) for k, s in down if k in placed)

    # ------------------------------------------------------------------ failures

    def forget(self, tier: str, keys: Iterable[bytes]) -> None:
        """The tier does not hold ``keys`` after all (a failed copy, a corrupt or vanished
        record): drop them; pinned ones leave at their last unpin."""
        index = self.cpu if tier == "cpu" else self.ssd if tier == "ssd" else None
        if index is None:
            raise ValueError(f"tier: expected 'cpu' or 'ssd', got {tier!r}")
        self._drop_keys(index, tier, [k for k in keys if k in index])

    def forget_pairs(self, lost: Iterable[tuple[str, bytes]]) -> None:
        """:meth:`forget` for ``(tier, key)`` pairs."""
        lost = list(lost)
        for tier in ("cpu", "ssd"):
            keys = [k for t, k in lost if t == tier]
            if keys and (self.cpu if tier == "cpu" else self.ssd) is not None:
                self.forget(tier, keys)

    def _drop_keys(self, index: SlotIndex, tier: str, keys: list[bytes]) -> None:
        doomed = self._doomed.setdefault(id(index), set())
        for key in keys:
            if index.pin_count(key):
                doomed.add(key)
            else:
                index.pop(key)
        self._emit("lost", tier, keys, self.clock())

    def _release(self, plan_id: int) -> None:
        for index, key in self._pins.pop(plan_id, ()):
            index.unpin(key)
            doomed = self._doomed.get(id(index))
            if doomed and key in doomed and not index.pin_count(key):
                doomed.discard(key)
                index.pop(key)

    # ------------------------------------------------------------------ events

    def _plan_id(self) -> int:
        self._next_plan += 1
        return self._next_plan

    def _emit(self, kind: str, tier: str, keys: Sequence[bytes], now: float) -> None:
        if not keys:
            return
        for observer in self._observers:
            observer(kind, tier, keys, now)
        if self._events is not None:
            self._events.append(PolicyEvent(kind, tier, tuple(keys), now))

    def add_observer(self, observer: Observer) -> None:
        self._observers.append(observer)

    def take_events(self) -> list[PolicyEvent]:
        """Events recorded since the last call (empty unless ``record_events`` is on)."""
        if self._events is None:
            return []
        out, self._events = self._events, []
        return out

    def check(self) -> None:
        """Assert the accounting invariants (tests)."""
        for index in (self.cpu, self.ssd):
            if index is not None:
                index.check()
        held: dict[tuple[int, bytes], int] = {}
        for pins in self._pins.values():
            for index, key in pins:
                held[(id(index), key)] = held.get((id(index), key), 0) + 1
        for (index_id, key), n in held.items():
            index = self.cpu if self.cpu is not None and id(self.cpu) == index_id else self.ssd
            assert index is not None and index.pin_count(key) == n, (
                f"key {key.hex()[:12]}: plans hold {n} pins, the index counts {index.pin_count(key) if index else 0}")
        for index in (self.cpu, self.ssd):
            if index is not None:
                stray = [k for k in index._pins if (id(index), k) not in held]
                assert not stray, f"{len(stray)} pins no open plan holds"
