"""The SSD tier's log of keys it dropped on its own (no files)."""

from __future__ import annotations

import threading

import pytest

from kvstrata.tiers.ssd.lost import LOST_MAX, LostKeys

NS = b"N" * 16


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_keys_come_back_once_oldest_first_without_prefix():
    lost = LostKeys(NS)
    lost.add([NS + k(2), NS + k(1), b"O" * 16 + k(3)])  # another namespace: ignored
    lost.add([NS + k(2)])                                # reported again: now the newest
    assert lost.take() == [k(1), k(2)]
    assert lost.take() == []


def test_a_key_stored_again_is_withdrawn():
    lost = LostKeys(NS)
    lost.add([NS + k(i) for i in range(4)])
    lost.withdraw([NS + k(1)])
    lost.withdraw([NS + k(3), NS + k(9)])
    assert lost.take() == [k(0), k(2)]


def test_beyond_the_limit_the_oldest_are_dropped_and_counted():
    lost = LostKeys(NS, limit=3)
    lost.add([NS + k(i) for i in range(5)])
    lost.add([NS + k(5)])
    assert lost.overflow == 3 and len(lost) == 3
    assert lost.take() == [k(3), k(4), k(5)]
    assert LOST_MAX == 1_000_000
    with pytest.raises(ValueError, match="^limit"):
        LostKeys(NS, limit=0)


def test_adding_and_taking_from_several_threads_loses_nothing():
    lost = LostKeys(NS)
    taken: list[bytes] = []
    done = threading.Event()

    def take() -> None:
        while not done.is_set():
            taken.extend(lost.take())

    def add(base: int) -> None:
        for i in range(base, base + 5000):
            lost.add([NS + k(i)])

    taker = threading.Thread(target=take)
    taker.start()
    adders = [threading.Thread(target=add, args=(n * 5000,)) for n in range(4)]
    for t in adders:
        t.start()
    for t in adders:
        t.join()
    done.set()
    taker.join()
    taken.extend(lost.take())
    assert sorted(taken) == [k(i) for i in range(20_000)]
