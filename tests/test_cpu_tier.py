"""CPU DRAM tier: SlotIndex bookkeeping, slab copies, eviction order, pins, bad input."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tierkv.cpu_tier import CPUTier, PinnedError, SlotIndex
from tierkv.errors import ConfigError

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
    code = ("import sys, tierkv, tierkv.cpu_tier, tierkv.ssd_tier; "
            "idx = tierkv.cpu_tier.SlotIndex(2); idx.allocate(b'x'); "
            "assert not {'torch', 'lmdb', 'zstandard'} & set(sys.modules), sys.modules.keys()")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------- model check

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
        self.lru.pop(key, None)
        self.pins[key] = self.pins.get(key, 0) + 1

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        key = data.draw(st.sampled_from(sorted(self.pins)))
        self.idx.unpin(key)
        self.pins[key] -= 1
        if not self.pins[key]:
            del self.pins[key]
            self.lru[key] = None

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
