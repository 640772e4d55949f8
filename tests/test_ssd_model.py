"""The SSD tier against a plain reference model (Hypothesis state machine): what it holds
after puts, discards, evictions, reads and reopening, and what it reports lost."""

from __future__ import annotations

import functools
import hashlib
import shutil
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstrata.tiers.ssd import SSDTier, capacity_blocks

BLOCK = 128 * 1024
CAPACITY = 1024**2          # holds capacity_blocks(CAPACITY, BLOCK) = 7 blocks: evictions are routine
NKEYS = 20
KEYS = st.integers(0, NKEYS - 1)


def k(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


@functools.lru_cache(maxsize=None)
def data(i: int) -> bytes:
    """Every put of a key carries the same bytes, so the model knows them exactly."""
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


class SSDTierModel(RuleBasedStateMachine):
    """Reference: the set of keys the tier holds, as its owner would track it: a put adds
    the key, ``discard_many`` removes it, and every key ``take_lost`` reports is removed."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvstrata-model-"))
        self.tier = self._open()
        self.held: set[int] = set()

    def _open(self) -> SSDTier:
        return SSDTier(self.dir / "ssd", capacity_bytes=CAPACITY, fingerprint="model",
                       compression="none", block_nbytes=BLOCK)

    def teardown(self) -> None:
        self.tier.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _take_lost(self) -> None:
        for key in self.tier.take_lost():
            i = next(i for i in range(NKEYS) if k(i) == key)
            assert i in self.held, f"key {i} reported lost but it was not held"
            assert key not in self.tier, f"key {i} reported lost but it is still there"
            self.held.discard(i)

    @rule(ids=st.lists(KEYS, min_size=1, max_size=6))
    def put(self, ids: list[int]) -> None:
        for i in ids:
            assert self.tier.put(k(i), data(i))
            self.held.add(i)

    @rule(ids=st.lists(KEYS, min_size=1, max_size=6))
    def discard(self, ids: list[int]) -> None:
        self.tier.discard_many([k(i) for i in ids])
        self.held.difference_update(ids)
        assert not any(k(i) in self.tier for i in ids)

    @rule(ids=st.lists(KEYS, min_size=1, max_size=8), into=st.booleans())
    def get(self, ids: list[int], into: bool) -> None:
        if into:
            rows = np.zeros((len(ids), BLOCK), dtype=np.uint8)
            hits = self.tier.get_into([k(i) for i in ids], list(rows))
            got = [r.tobytes() if h else None for r, h in zip(rows, hits)]
        else:
            got = self.tier.get_many([k(i) for i in ids])
        for i, g in zip(ids, got):
            assert g is None or g == data(i), f"wrong bytes for key {i}"
            if i not in self.held:
                assert g is None, f"key {i} was discarded (or never put) but read back"

    @rule()
    def flush(self) -> None:
        assert self.tier.flush()
        self._take_lost()
        assert sorted(self.tier.keys()) == sorted(k(i) for i in self.held)
        s = self.tier.stats()
        assert s["current_bytes"] <= CAPACITY and s["queued_bytes"] == 0
        assert len(self.held) <= capacity_blocks(CAPACITY, BLOCK)

    @precondition(lambda self: self.held)
    @rule()
    def reopen(self) -> None:
        self.flush()          # reports live in memory: take them before closing
        self.tier.close()
        self.tier = self._open()
        assert self.tier.take_lost() == []
        assert sorted(self.tier.keys()) == sorted(k(i) for i in self.held)

    @invariant()
    def never_corrupt_or_dropped(self) -> None:
        s = self.tier.stats()
        assert s["corrupt_deleted"] == s["dropped_no_room"] == s["dropped_write_error"] == 0
        assert s["available"]


SSDTierModel.TestCase.settings = settings(max_examples=25, stateful_step_count=30,
                                          deadline=None)
test_ssd_tier_model = SSDTierModel.TestCase
