"""CPU DRAM tier: SlotIndex bookkeeping, slab copies, eviction order, pins, bad input."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstrata.policy.slot_index import PinnedError, SlotIndex
from kvstrata.tiers.host import CPUTier
from kvstrata.errors import ConfigError

B = 64  # block bytes in most tests


def k(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8  # a 32-byte "hash"


def block(i: int, n: int = B) -> np.ndarray:
    return np.full(n, i % 251, dtype=np.uint8)


def make(nslots: int = 4, **kw) -> tuple[CPUTier, list[tuple[bytes, bytes]]]:
    evicted: list[tuple[bytes, bytes]] = []
    tier = CPUTier(nslots * B + B - 1, B, on_evict=lambda key, v: evicted.append((key, bytes(v))),
                   **kw)
    return tier, evicted


# ---------------------------------------------------------------------- single blocks

def test_capacity_is_exact_and_slab_is_preallocated():
    tier, _ = make(4)
    assert tier.num_slots == 4 and tier.capacity_bytes == 4 * B
    assert tier.slab.shape == (4, B) and tier.slab.dtype == torch.uint8
    assert not tier.slab.is_pinned()  # no CUDA here
    for i in range(20):
        assert tier.put(k(i), block(i))
        assert len(tier) == min(i + 1, 4)
    tier.index.check()


def test_round_trip_and_read_only_view():
    tier, _ = make()
    data = np.random.default_rng(0).integers(0, 256, B, dtype=np.uint8)
    tier.put(k(1), torch.from_numpy(data.copy()))
    view = tier.get(k(1))
    assert view is not None and np.array_equal(view, data)
    with pytest.raises(ValueError):
        view[0] = 1
    assert tier.get(k(2)) is None
    assert k(1) in tier and k(2) not in tier
    tier.put(k(3), bytes(range(B)))
    assert bytes(tier.get(k(3))) == bytes(range(B))


@pytest.mark.parametrize("bad", [-1, -4, 4, 100, True, 1.0])
def test_view_refuses_a_slot_outside_the_slab(bad):
    """``view(-1)`` used to return the last slot (another block's bytes)."""
    tier, _ = make(4)
    for i in range(4):
        tier.put(k(i), block(i))
    with pytest.raises(IndexError, match="slot: expected 0..3"):
        tier.view(bad)
    assert [int(tier.view(s)[0]) for s in range(4)] == sorted(int(block(i)[0]) for i in range(4))


def test_non_uint8_tensors_are_stored_by_bytes():
    tier = CPUTier(4 * 128, 128)
    x = torch.randn(64, dtype=torch.bfloat16)
    tier.put(k(1), x)
    got = torch.from_numpy(tier.get(k(1)).copy()).view(torch.bfloat16)
    assert torch.equal(got, x)


def test_eviction_is_lru_and_callback_sees_old_bytes_before_reuse():
    tier, evicted = make(3)
    for i in range(3):
        tier.put(k(i), block(i))
    tier.get(k(0))                     # order now 1, 2, 0
    tier.put(k(3), block(3))           # evicts 1
    tier.put(k(1), block(11))          # evicts 2
    tier.put(k(0), block(100))         # present: overwritten in place, now MRU
    tier.put(k(4), block(4))           # evicts 3
    assert [key for key, _ in evicted] == [k(1), k(2), k(3)]
    assert [v for _, v in evicted] == [bytes(block(1)), bytes(block(2)), bytes(block(3))]
    assert list(tier.index) == [k(1), k(0), k(4)]
    assert bytes(tier.get(k(0))) == bytes(block(100))


def test_pinned_blocks_are_never_evicted():
    tier, evicted = make(2)
    tier.put(k(0), block(0))
    tier.put(k(1), block(1))
    assert tier.pin(k(0)) == tier.slot_of(k(0))
    tier.put(k(2), block(2))  # must evict 1, not the pinned 0
    assert evicted[-1][0] == k(1) and k(0) in tier
    tier.pin(k(2))
    assert tier.put(k(3), block(3)) is False  # everything pinned: dropped, nothing evicted
    assert k(3) not in tier and len(evicted) == 1
    assert tier.stats()["dropped_all_pinned"] == 1
    with pytest.raises(PinnedError):
        tier.index.allocate(k(3))
    with pytest.raises(PinnedError):
        tier.pop(k(0))
    tier.unpin(k(2))
    tier.unpin(k(0))                           # last unpinned: most recently used
    tier.put(k(3), block(3))
    assert evicted[-1][0] == k(2)
    with pytest.raises(RuntimeError):
        tier.unpin(k(0))
    with pytest.raises(KeyError):
        tier.pin(k(99))


def test_pins_nest():
    idx = SlotIndex(1)
    idx.allocate(k(0))
    idx.pin(k(0))
    idx.pin(k(0))
    idx.unpin(k(0))
    assert idx.try_allocate(k(1)) is None
    idx.unpin(k(0))
    assert idx.allocate(k(1)) == (0, k(0))


def test_pop_frees_the_slot_without_callback():
    tier, evicted = make(2)
    tier.put(k(0), block(0))
    assert tier.pop(k(0)) and not tier.pop(k(0))
    assert len(tier) == 0 and tier.index.num_free == 2 and not evicted


def test_on_evict_errors_are_logged_not_raised(caplog):
    def boom(key: bytes, view: np.ndarray) -> None:
        raise OSError("disk gone")
    tier = CPUTier(B, B, on_evict=boom)
    with caplog.at_level(logging.ERROR):
        tier.put(k(0), block(0))
        tier.put(k(1), block(1))
        tier.put(k(2), block(2))
    assert tier.stats()["evict_callback_errors"] == 2
    assert sum("on_evict raised" in r.message for r in caplog.records) == 1
    assert bytes(tier.get(k(2))) == bytes(block(2))


# ---------------------------------------------------------------------- batches

@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_put_many_get_many_round_trip(kind):
    rng = np.random.default_rng(1)
    tier, _ = make(8)
    data = rng.integers(0, 256, (6, B), dtype=np.uint8)
    keys = [k(i) for i in range(6)]
    src = torch.from_numpy(data.copy()) if kind == "torch" else data.copy()
    assert tier.put_many(keys, src) == [True] * 6
    out = torch.zeros(6, B, dtype=torch.uint8) if kind == "torch" else np.zeros((6, B), np.uint8)
    assert tier.get_many(keys[::-1], out) == [True] * 6
    assert np.array_equal(np.asarray(out), data[::-1])


def test_get_many_partial_hits_leave_miss_rows_untouched():
    tier, _ = make(4)
    tier.put_many([k(0), k(1)], np.stack([block(0), block(1)]))
    out = np.full((3, B), 7, np.uint8)
    assert tier.get_many([k(1), k(9), k(0)], out) == [True, False, True]
    assert np.array_equal(out, np.stack([block(1), np.full(B, 7, np.uint8), block(0)]))
    assert tier.stats()["misses"] == 1


def test_get_many_marks_hits_recently_used():
    tier, evicted = make(3)
    tier.put_many([k(0), k(1), k(2)], np.stack([block(i) for i in range(3)]))
    tier.get_many([k(0)], np.empty((1, B), np.uint8))
    tier.put(k(3), block(3))
    assert evicted[0][0] == k(1)


def test_put_many_evicts_with_old_bytes_then_copies():
    tier, evicted = make(2)
    tier.put_many([k(0), k(1)], np.stack([block(0), block(1)]))
    tier.put_many([k(2), k(3)], np.stack([block(2), block(3)]))
    assert evicted == [(k(0), bytes(block(0))), (k(1), bytes(block(1)))]
    assert bytes(tier.get(k(3))) == bytes(block(3))


def test_put_many_larger_than_tier_keeps_the_first_blocks():
    tier, evicted = make(2)
    flags = tier.put_many([k(i) for i in range(4)], np.stack([block(i) for i in range(4)]))
    assert flags == [True, True, False, False]
    assert bytes(tier.get(k(0))) == bytes(block(0)) and bytes(tier.get(k(1))) == bytes(block(1))
    assert not evicted and tier.index.pin_count(k(0)) == 0
    tier.index.check()


def test_put_many_repeated_key_last_row_wins():
    tier, _ = make(4)
    assert tier.put_many([k(0), k(1), k(0)], np.stack([block(0), block(1), block(2)])) == [True] * 3
    assert bytes(tier.get(k(0))) == bytes(block(2)) and len(tier) == 2


def test_explicit_slot_copies_through_slab():
    tier, _ = make(4)
    tier.put(k(5), block(5))
    slot = tier.slot_of(k(5))
    tier.slab[slot].fill_(9)
    assert bytes(tier.get(k(5))) == bytes(np.full(B, 9, np.uint8))


# ---------------------------------------------------------------------- bad input

def test_bad_input_names_the_argument():
    with pytest.raises(ConfigError, match="capacity_bytes"):
        CPUTier(B - 1, B)
    with pytest.raises(ConfigError, match="block_nbytes"):
        CPUTier(1024, 0)
    with pytest.raises(ConfigError, match="on_evict"):
        CPUTier(1024, B, on_evict=3)  # type: ignore[arg-type]
    tier, _ = make()
    with pytest.raises(ValueError, match="^key"):
        tier.put("abc", block(0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^key"):
        tier.get(7)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^data"):
        tier.put(k(0), np.zeros(B + 1, np.uint8))
    with pytest.raises(ValueError, match="^data"):
        tier.put_many([k(0), k(1)], np.zeros((1, B), np.uint8))
    with pytest.raises(ValueError, match="^data"):
        tier.put(k(0), torch.zeros(2 * B, dtype=torch.uint8)[::2])
    with pytest.raises(ValueError, match="^out"):
        tier.get_many([k(0)], np.zeros((2, B), np.uint8))
    with pytest.raises(ValueError, match="^keys"):
        tier.put_many(["a"], np.zeros((1, B), np.uint8))  # type: ignore[list-item]
    assert len(tier) == 0
    with pytest.raises(ConfigError, match="num_slots"):
        SlotIndex(0)


def test_import_does_not_load_torch():
    code = ("import sys, kvstrata, kvstrata.tiers.host, kvstrata.tiers.ssd; "
            "assert not {'torch', 'lmdb', 'zstandard'} & set(sys.modules), sys.modules.keys()")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_policy_is_bytes_free():
    """The policy package loads no numpy, torch or storage library."""
    code = ("import sys, kvstrata.policy as p; "
            "pol = p.TierPolicy(p.PolicySpec(slab_slots=2, store_slots=2)); "
            "pol.complete_store(pol.prepare_store([0], [b'x' * 32], 'computed')); "
            "assert pol.lookup([b'x' * 32]) == ['cpu'], pol.lookup([b'x' * 32]); "
            "assert not {'numpy', 'torch', 'lmdb', 'zstandard'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------- model check

def model_pin(model, key: bytes) -> None:
    """Reference bookkeeping of a pin: a pinned key leaves the LRU order."""
    model.lru.pop(key, None)
    model.pins[key] = model.pins.get(key, 0) + 1


def model_unpin(model, key: bytes) -> None:
    """Reference bookkeeping of an unpin: the last one puts the key back as most recent."""
    model.pins[key] -= 1
    if not model.pins[key]:
        del model.pins[key]
        model.lru[key] = None


class SlotIndexModel(RuleBasedStateMachine):
    """SlotIndex against a plain model: an LRU list of unpinned keys plus pin counts."""

    N = 4

    def __init__(self) -> None:
        super().__init__()
        self.idx = SlotIndex(self.N)
        self.lru: OrderedDict[bytes, None] = OrderedDict()
        self.pins: dict[bytes, int] = {}

    keys = st.integers(0, 7).map(lambda i: bytes([i]))

    def present(self) -> set[bytes]:
        return set(self.lru) | set(self.pins)

    @rule(key=keys)
    def allocate(self, key):
        got = self.idx.try_allocate(key)
        if key in self.present():
            assert got is not None and got[1] is None
            if key in self.lru:
                self.lru.move_to_end(key)
        elif len(self.present()) < self.N:
            assert got is not None and got[1] is None
            self.lru[key] = None
        elif self.lru:
            victim = next(iter(self.lru))
            assert got is not None and got[1] == victim
            del self.lru[victim]
            self.lru[key] = None
        else:
            assert got is None

    @rule(key=keys)
    def touch(self, key):
        assert self.idx.touch(key) == (key in self.present())
        if key in self.lru:
            self.lru.move_to_end(key)

    @rule(key=keys)
    def pin(self, key):
        if key not in self.present():
            with pytest.raises(KeyError):
                self.idx.pin(key)
            return
        self.idx.pin(key)
        model_pin(self, key)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        key = data.draw(st.sampled_from(sorted(self.pins)))
        self.idx.unpin(key)
        model_unpin(self, key)

    @rule(key=keys)
    def pop(self, key):
        if key in self.pins:
            with pytest.raises(PinnedError):
                self.idx.pop(key)
            return
        assert (self.idx.pop(key) is not None) == (key in self.lru)
        self.lru.pop(key, None)

    @invariant()
    def agrees(self):
        self.idx.check()
        assert list(self.idx)[:len(self.lru)] == list(self.lru)
        assert set(self.idx) == self.present() and len(self.idx) == len(self.present())
        for key, n in self.pins.items():
            assert self.idx.pin_count(key) == n


TestSlotIndexModel = SlotIndexModel.TestCase
TestSlotIndexModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# ---------------------------------------------------------------------- batch bookkeeping

class SlotIndexBatchModel(SlotIndexModel):
    """The model above plus the batch methods: ``allocate_many`` is ``try_allocate`` per
    key except that keys placed by the call are never evicted by it."""

    @rule(batch=st.lists(SlotIndexModel.keys, max_size=6))
    def allocate_many(self, batch):
        placed: set[bytes] = set()
        expect_slot: list[bool] = []
        expect_evicted: list[bytes] = []
        for key in batch:
            if key in self.present():
                if key in self.lru:
                    self.lru.move_to_end(key)
                    placed.add(key)
                expect_slot.append(True)
                continue
            if len(self.present()) == self.N:
                victim = next(iter(self.lru), None)
                if victim is None or victim in placed:
                    expect_slot.append(False)
                    continue
                del self.lru[victim]
                expect_evicted.append(victim)
            self.lru[key] = None
            placed.add(key)
            expect_slot.append(True)
        slots, evicted = self.idx.allocate_many(batch)
        assert [s is not None for s in slots] == expect_slot
        assert [key for key, _ in evicted] == expect_evicted
        for key, slot in zip(batch, slots):
            assert slot is None or self.idx.lookup(key) == slot
        assert {slot for _, slot in evicted} <= set(slots)

    @rule(batch=st.lists(SlotIndexModel.keys, max_size=6))
    def touch_many(self, batch):
        self.idx.touch_many(batch)
        for key in batch:
            if key in self.lru:
                self.lru.move_to_end(key)

    @invariant()
    def batch_queries_agree(self):
        every = [bytes([i]) for i in range(8)]
        assert self.idx.lookup_many(every) == [self.idx.lookup(key) for key in every]
        assert self.idx.pinned_among(every) == set(self.pins)


TestSlotIndexBatchModel = SlotIndexBatchModel.TestCase
TestSlotIndexBatchModel.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


def sequential_allocate(idx: SlotIndex, batch: list[bytes]
                        ) -> tuple[list[int | None], list[tuple[bytes, int]]]:
    """try_allocate per key, pinning each placed key until the end so that none is evicted."""
    slots: list[int | None] = []
    evicted: list[tuple[bytes, int]] = []
    ours: list[bytes] = []
    for key in batch:
        got = idx.try_allocate(key)
        if got is None:
            slots.append(None)
            continue
        slot, victim = got
        if victim is not None:
            evicted.append((victim, slot))
        if idx.pin_count(key) == 0:
            idx.pin(key)
            ours.append(key)
        slots.append(slot)
    for key in ours:
        idx.unpin(key)
    return slots, evicted


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "pin", "pop", "touch"]), st.integers(0, 11)),
                    max_size=30),
       batch=st.lists(st.integers(0, 11), max_size=8, unique=True))
def test_allocate_many_matches_sequential_try_allocate(ops, batch):
    a, b = SlotIndex(5), SlotIndex(5)
    for idx in (a, b):
        for op, i in ops:
            key = k(i)
            if op == "alloc":
                idx.try_allocate(key)
            elif op == "pin" and key in idx:
                idx.pin(key)
            elif op == "pop" and key in idx and not idx.pin_count(key):
                idx.pop(key)
            elif op == "touch":
                idx.touch(key)
    keys = [k(i) for i in batch]
    assert a.allocate_many(keys) == sequential_allocate(b, keys)
    assert list(a) == list(b) and a.num_free == b.num_free
    assert all(a.lookup(key) == b.lookup(key) for key in keys + [k(i) for i in range(12)])
    a.check()


def test_allocate_many_fills_free_slots_in_order_then_evicts_lru():
    idx = SlotIndex(4)
    assert idx.allocate_many([k(0), k(1)]) == ([0, 1], [])
    assert idx.allocate_many([k(2), k(3), k(4), k(5)]) == ([2, 3, 0, 1], [(k(0), 0), (k(1), 1)])
    idx.pin(k(2))
    assert idx.allocate_many([k(6), k(7), k(8), k(9)]) == ([3, 0, 1, None], [(k(3), 3), (k(4), 0), (k(5), 1)])
    assert list(idx) == [k(6), k(7), k(8), k(2)]
    with pytest.raises(ValueError, match="^keys"):
        idx.allocate_many([k(1), "x"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="^keys"):
        idx.lookup_many([7])  # type: ignore[list-item]
    idx.check()


# ---------------------------------------------------------------------- batches against a model

class CPUTierModel(RuleBasedStateMachine):
    """put_many/get_many/pins against a plain model of contents, LRU order and evictions."""

    N = 4

    def __init__(self) -> None:
        super().__init__()
        self.tier, self.evicted = make(self.N)
        self.data: dict[bytes, bytes] = {}
        self.lru: OrderedDict[bytes, None] = OrderedDict()
        self.pins: dict[bytes, int] = {}
        self.expect_evicted: list[tuple[bytes, bytes]] = []

    keys = st.integers(0, 7).map(k)

    @rule(batch=st.lists(st.tuples(keys, st.integers(0, 250)), max_size=7))
    def put_many(self, batch):
        last = {key: i for i, (key, _) in enumerate(batch)}
        placed: set[bytes] = set()
        stored: set[bytes] = set()
        for key, row in last.items():
            if key in self.pins:
                stored.add(key)
                continue
            if key in self.lru:
                self.lru.move_to_end(key)
            elif len(self.data) == self.N:
                victim = next(iter(self.lru), None)
                if victim is None or victim in placed:
                    continue
                del self.lru[victim]
                self.expect_evicted.append((victim, self.data.pop(victim)))
            self.lru[key] = None
            self.data[key] = bytes(block(batch[row][1]))
            placed.add(key)
            stored.add(key)
        rows = np.stack([block(v) for _, v in batch]) if batch else np.empty((0, B), np.uint8)
        flags = self.tier.put_many([key for key, _ in batch], rows)
        assert flags == [key in stored for key, _ in batch]

    @rule(batch=st.lists(keys, max_size=6), fill=st.integers(0, 250))
    def get_many(self, batch, fill):
        out = np.full((len(batch), B), fill, np.uint8)
        hits = self.tier.get_many(batch, out)
        assert hits == [key in self.data for key in batch]
        for key, row in zip(batch, out):
            assert bytes(row) == self.data.get(key, bytes(np.full(B, fill, np.uint8)))
            if key in self.lru:
                self.lru.move_to_end(key)

    @rule(key=keys)
    def pin(self, key):
        if key in self.data:
            self.tier.pin(key)
            model_pin(self, key)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        key = data.draw(st.sampled_from(sorted(self.pins)))
        self.tier.unpin(key)
        model_unpin(self, key)

    @invariant()
    def agrees(self):
        self.tier.index.check()
        assert list(self.tier.index) == list(self.lru) + [key for key in self.tier.index._pins]
        assert set(self.tier.index._pins) == set(self.pins)
        assert self.evicted == self.expect_evicted
        for key, value in self.data.items():
            assert bytes(self.tier.view(self.tier.slot_of(key))) == value


TestCPUTierModel = CPUTierModel.TestCase
TestCPUTierModel.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)


# ---------------------------------------------------------------------- copy_rows

def copy_rows_reference(src: np.ndarray, src_rows, dst: np.ndarray, dst_rows) -> None:
    for s, d in zip(src_rows, dst_rows):
        dst[d] = src[s]


@pytest.mark.parametrize("src_rows, dst_rows", [
    ([2, 3, 4], [5, 6, 7]),              # both runs: one slice
    (range(3), range(4, 7)),
    ([7, 0, 3], [1, 2, 3]),              # gather into a run
    ([0, 1, 2], [7, 0, 4]),              # scatter from a run
    ([5, 1, 6], [3, 7, 0]),              # neither
    ([0, 1, 3], [0, 1, 2]),              # almost a run
    ([2, 3, 4], [0, 1, 3]),
    ([-1, -2, 0], [0, 1, 2]),            # negative rows keep numpy's meaning
    ([0, 1, 2], [-3, -2, -1]),
    (np.array([4, 5, 6]), np.array([1, 2, 3])),
    ([np.int64(6), np.int64(2)], [0, 1]),
    ([0, 1, 2], [4, 4, 5]),              # a repeated destination: the last row wins
    ([3, 3, 3], [0, 1, 2]),
    ([], []),
])
def test_copy_rows_matches_row_by_row(src_rows, dst_rows):
    from kvstrata.tiers.buffers import copy_rows
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, (8, 16), dtype=np.uint8)
    got = np.zeros((8, 16), np.uint8)
    want = got.copy()
    copy_rows(src, src_rows, got, dst_rows)
    copy_rows_reference(src, src_rows, want, dst_rows)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("src_rows, dst_rows", [([0, 8], [0, 1]), ([0, 1], [3, 8]), ([0, 1], [8, 9])])
def test_copy_rows_out_of_range_raises(src_rows, dst_rows):
    from kvstrata.tiers.buffers import copy_rows
    with pytest.raises(IndexError):
        copy_rows(np.zeros((8, 4), np.uint8), src_rows, np.zeros((8, 4), np.uint8), dst_rows)


# ---------------------------------------------------------------------- page-locking the slab

def _pin_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kvstrata.tiers.host" and r.levelno >= logging.WARNING]


def test_pinning_asked_for_without_cuda_falls_back_with_one_warning(caplog):
    from kvstrata.tiers.host import HostSlab

    assert not torch.cuda.is_available()  # CUDA cannot exist on this machine: the no-CUDA failure is real
    with caplog.at_level(logging.WARNING):
        slab = HostSlab(5, B, pin_memory=True)
        tier = CPUTier(4 * B, B, pin_memory=True)
    warnings = _pin_warnings(caplog)
    assert len(warnings) == 2  # one per slab, not one per chunk
    assert "CUDA is not available" in warnings[0].getMessage() and "~10x slower" in warnings[0].getMessage()
    assert not slab.pinned and not slab.tensor.is_pinned() and not tier.pinned
    slab.write([3], [k(3)], np.stack([block(3)]))
    assert slab.holds(3, k(3)) and bytes(slab.view(3)) == bytes(block(3))


@pytest.mark.parametrize("pin", [None, False])
def test_no_pinning_wanted_means_no_warning(caplog, pin):
    from kvstrata.tiers.host import HostSlab

    with caplog.at_level(logging.WARNING):
        slab = HostSlab(3, B, pin_memory=pin)
    assert not slab.pinned and not _pin_warnings(caplog)


class FakePinRuntime:
    """Stands in for cudaHostRegister/cudaHostUnregister, which cannot run without CUDA
    (absent on this machine); records calls and fails the chunk numbered ``fail_at``."""

    def __init__(self, fail_at: int | None = None, raise_at: int | None = None) -> None:
        self.fail_at, self.raise_at = fail_at, raise_at
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.threads: set[int] = set()

    def register(self, ptr: int, size: int) -> int:
        import threading

        self.threads.add(threading.get_ident())
        if len(self.registered) == self.raise_at:
            raise RuntimeError("driver gone")
        if len(self.registered) == self.fail_at:
            return 2
        self.registered.append((ptr, size))
        return 0

    def unregister(self, ptr: int) -> None:
        self.unregistered.append(ptr)

    def error_text(self, code: int) -> str:
        return f"out of memory (error {code})"


@pytest.fixture
def fake_cuda(monkeypatch):
    from kvstrata.tiers import host

    def install(runtime: FakePinRuntime, chunk: int = 4 << 20) -> FakePinRuntime:
        monkeypatch.setattr(host, "_pin_runtime", lambda: (runtime, ""))
        monkeypatch.setattr(host, "PIN_CHUNK_BYTES", chunk)
        return runtime

    return install


def test_slab_is_registered_in_page_aligned_chunks_off_the_callers_thread(fake_cuda, caplog):
    import gc
    import threading

    from kvstrata.tiers.host import HostSlab

    rt = fake_cuda(FakePinRuntime())
    with caplog.at_level(logging.WARNING):
        slab = HostSlab(10, 1_000_000, pin_memory=True)
    assert slab.pinned and not _pin_warnings(caplog)
    base, chunk, nbytes = slab.tensor.data_ptr(), 4 << 20, 10_000_000
    assert base % (2 << 20) == 0  # chunk boundaries never split a 2 MiB (huge) page
    assert rt.registered == [(base + off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]
    assert len(rt.registered) == 3
    assert threading.get_ident() not in rt.threads  # a failure's CUDA error stays off this thread
    rows = np.stack([block(i, 1_000_000) for i in range(10)])
    slab.write(list(range(10)), [k(i) for i in range(10)], rows)
    out = np.zeros((10, 1_000_000), dtype=np.uint8)
    slab.read(list(range(10)), out, range(10))
    assert np.array_equal(out, rows)
    row = slab.tensor[9]  # a view keeps the memory, and its registration, alive
    del slab, out
    gc.collect()
    assert rt.unregistered == []
    del row
    gc.collect()
    assert sorted(rt.unregistered) == [ptr for ptr, _ in rt.registered]


@pytest.mark.parametrize("failure", [dict(fail_at=2), dict(raise_at=1), dict(fail_at=0)])
def test_a_failed_chunk_releases_the_others_and_leaves_a_pageable_slab(fake_cuda, caplog, failure):
    from kvstrata.tiers.host import HostSlab

    rt = fake_cuda(FakePinRuntime(**failure), chunk=2 << 20)
    with caplog.at_level(logging.WARNING):
        slab = HostSlab(10, 1_000_000, pin_memory=True)
    warnings = _pin_warnings(caplog)
    assert len(warnings) == 1 and "~10x slower" in warnings[0].getMessage()
    assert ("out of memory (error 2)" if "fail_at" in failure else "driver gone") in warnings[0].getMessage()
    assert not slab.pinned
    assert sorted(rt.unregistered) == [ptr for ptr, _ in rt.registered]  # nothing stays locked
    assert resident_bytes(slab.array) >= slab.array.nbytes  # faulted in, as a pageable slab is
    slab.write([1], [k(1)], np.stack([block(1, 1_000_000)]))
    assert bytes(slab.view(1)) == bytes(block(1, 1_000_000))
    del slab
    assert sorted(rt.unregistered) == [ptr for ptr, _ in rt.registered]  # and nothing is released twice


def resident_bytes(array: np.ndarray) -> int:
    """Bytes of the mapping that holds ``array`` that are in memory (its ``Rss`` in
    /proc/self/smaps)."""
    address, inside = array.ctypes.data, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the array")


def test_a_pageable_slab_is_in_memory_before_its_first_store():
    """A store into the slab must be a copy, not a page fault per 4 KiB page on the
    engine's critical path (measured: a 16 MiB store into fresh pages took 50-90 ms
    inside a CPU engine's step, against ~1 ms into resident ones)."""
    from kvstrata.tiers.host import HostSlab

    slab = HostSlab(48, 1 << 20, pin_memory=False)
    assert not slab.pinned
    assert resident_bytes(slab.array) >= 48 << 20
    assert not slab.array.any()  # and it reads as zeros, as fresh memory does


@pytest.mark.parametrize("pin_memory", [False, True])
def test_a_slab_larger_than_the_memory_available_is_refused_at_start(monkeypatch, fake_cuda, pin_memory):
    """Every byte of a slab is resident from the start, so one larger than the memory
    available would be killed at start-up (or squeeze the engine): a ConfigError naming
    the key instead. The available memory is mocked (this machine has what it has)."""
    import kvstrata.system.machine
    from kvstrata.tiers.host import HostSlab

    rt = fake_cuda(FakePinRuntime())
    monkeypatch.setattr(kvstrata.system.machine, "available_memory_bytes", lambda: 3 << 20)
    with pytest.raises(ConfigError, match=r"cpu\.capacity: .*0\.00 GiB of memory available"):
        HostSlab(4, 1 << 20, pin_memory=pin_memory)
    assert rt.registered == []
    assert HostSlab(3, 1 << 20, pin_memory=pin_memory).num_slots == 3  # what fits is made


def test_pinning_turned_off_never_touches_cuda(fake_cuda):
    from kvstrata.tiers.host import HostSlab

    rt = fake_cuda(FakePinRuntime())
    assert not HostSlab(4, B, pin_memory=False).pinned and rt.registered == []
