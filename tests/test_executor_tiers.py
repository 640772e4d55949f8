"""The executor over tiers reached by name: a store plan writes each key-addressed tier it
names, a load reads each block from the tier the plan names for it, a spill out of a
key-addressed tier is read before that tier's deletion runs, and a tier that fails is a
counted miss. A test-only key-addressed kind (a dict) runs beside a real SSD tier (LMDB on
disk) and a real slab; nothing is mocked."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from kvstrata.dataplane.executor import Executor
from kvstrata.policy.plans import COMPUTED, LoadPlan, Spill, StorePlan
from kvstrata.policy.tiers import Tier
from kvstrata.tiers.host import HostSlab
from kvstrata.tiers.kinds import TierKind, register, unregister
from kvstrata.tiers.ssd import SSDTier

sys.path.insert(0, str(Path(__file__).parent))
from dict_tier import DictStore  # noqa: E402

BLOCK = 4096


class Device:
    """Device rows in host memory (the executor's :class:`DeviceRows`)."""

    def __init__(self, n: int) -> None:
        self.block_nbytes = BLOCK
        self.rows = np.zeros((n, BLOCK), dtype=np.uint8)

    def read(self, block_ids: list[int]) -> np.ndarray:
        return self.rows[list(block_ids)].copy()

    def write(self, block_ids: list[int], rows: np.ndarray) -> None:
        self.rows[list(block_ids)] = rows
        return None

    def staging(self, n: int) -> np.ndarray:
        return np.empty((n, BLOCK), dtype=np.uint8)


@pytest.fixture
def tiers(tmp_path: Path) -> Iterator[tuple[Executor, Device, DictStore, SSDTier]]:
    register(TierKind(Tier("dict", medium="STORAGE", key="dict"), section="dict", capacity=lambda c, n: 8,
                      open=lambda o: DictStore(), backend=DictStore))
    ssd = SSDTier(tmp_path / "ssd", capacity_bytes=16 * 1024**2, fingerprint="m", block_nbytes=BLOCK)
    middle = DictStore()
    device = Device(16)
    rng = np.random.default_rng(7)
    device.rows[:] = rng.integers(0, 256, device.rows.shape, dtype=np.uint8)
    try:
        yield Executor(device, {"cpu": HostSlab(4, BLOCK, pin_memory=False), "dict": middle, "ssd": ssd}), \
            device, middle, ssd
    finally:
        ssd.close()
        unregister("dict")


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_each_tier_a_plan_names_gets_its_blocks_and_loads_read_them_back(tiers) -> None:
    ex, device, middle, ssd = tiers
    assert (ex.slab_tier, list(ex.stores)) == ("cpu", ["dict", "ssd"])
    sent = device.rows[:3].copy()
    plan = StorePlan(1, COMPUTED, [0, 1, 2], [key(0), key(1), key(2)], [0, -1, -1], {"dict": [1], "ssd": [0, 2]},
                     slab="cpu")
    assert ex.store(plan) == [] and ssd.flush()
    assert list(middle.data) == [key(1)] and sorted(ssd.keys()) == [key(0), key(2)]
    load = LoadPlan(2, "r", [8, 9, 10], [key(0), key(1), key(2)], [0, -1, -1], ["cpu", "dict", "ssd"], [-1, 1, -1],
                    slab="cpu")
    result = ex.load(load)
    assert result.loaded == 3 and result.lost == []
    assert np.array_equal(device.rows[8:11], sent)
    assert ex.slab is not None and ex.slab.holds(1, key(1))  # promoted from the dict tier
    stats = ex.stats()
    assert (stats["blocks_loaded_cpu"], stats["blocks_loaded_dict"], stats["blocks_loaded_ssd"]) == (1, 1, 1)
    assert (stats["blocks_stored_dict"], stats["blocks_stored_ssd"]) == (1, 2)


def test_a_spill_out_of_a_key_addressed_tier_is_read_before_its_deletion(tiers) -> None:
    ex, device, middle, ssd = tiers
    want = device.rows[5].copy()
    ex.store(StorePlan(1, COMPUTED, [5], [key(5)], [-1], {"dict": [0]}, slab="cpu"))
    # the policy evicted key 5 from the dict tier, and it cascades to the SSD tier
    lost = ex.evict([Spill("dict", -1, "ssd", key(5))], {"dict": [key(5)]})
    assert lost == [] and ssd.flush()
    assert middle.data == {} and list(ssd.keys()) == [key(5)]
    row = np.empty((BLOCK,), dtype=np.uint8)
    assert ssd.get_into([key(5)], [row]) == [True] and np.array_equal(row, want)
    # a spill whose record is gone is a counted failure naming the tier it was bound for
    assert ex.evict([Spill("dict", -1, "ssd", key(6))], {}) == [("ssd", key(6))]
    assert ex.stats()["spill_failures"] == 1 and ex.stats()["blocks_spilled"] == 1


def test_a_tier_that_raises_is_a_counted_miss_for_its_blocks_alone(tiers) -> None:
    ex, device, middle, ssd = tiers
    ex.store(StorePlan(1, COMPUTED, [0, 1], [key(0), key(1)], [-1, -1], {"dict": [0], "ssd": [1]}, slab="cpu"))
    assert ssd.flush()
    middle.broken = True
    result = ex.load(LoadPlan(2, "r", [8, 9], [key(1), key(0)], [-1, -1], ["ssd", "dict"], [-1, -1], slab="cpu"))
    assert result.loaded == 1 and result.lost == [("dict", key(0))]
    assert ex.stats()["load_failures_dict"] == 1 and ex.stats()["blocks_loaded_ssd"] == 1
    lost = ex.store(StorePlan(3, COMPUTED, [2], [key(2)], [-1], {"dict": [0]}, slab="cpu"))
    assert lost == [("dict", key(2))] and ex.stats()["store_failures_dict"] == 1
