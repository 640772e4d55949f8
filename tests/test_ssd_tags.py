"""Tags kept beside SSD records (what the vLLM plugin announces after a restart): written
and deleted with their record, read by the owner and beside it, absent from an index
written before tags existed."""

from __future__ import annotations

from pathlib import Path

import lmdb
import pytest

from kvstrata.tiers.ssd import SSDTier
from kvstrata.tiers.ssd.tier import MAX_TAG_LEN, read_keys, read_tags

FP = b"tags-fingerprint"
BLOCK = 65536


def open_tier(path: Path, capacity: int = 64 * BLOCK * 2) -> SSDTier:
    return SSDTier(path, capacity_bytes=capacity, fingerprint=FP, block_nbytes=BLOCK)


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def test_tags_follow_their_records(tmp_path: Path) -> None:
    path = tmp_path / "t"
    with open_tier(path) as tier:
        for i in range(10):
            assert tier.put(key(i), bytes([i]) * BLOCK, tag=b"tag-%d" % i if i % 2 else None)
        assert tier.flush()
        assert tier.tags() == {key(i): b"tag-%d" % i for i in range(1, 10, 2)}
        tier.discard_many([key(1), key(2)])
        assert tier.flush()
        assert set(tier.tags()) == {key(i) for i in (3, 5, 7, 9)}
    assert read_tags(path, FP) == {key(i): b"tag-%d" % i for i in (3, 5, 7, 9)}  # beside no owner
    with open_tier(path) as tier:  # reopened: kept; read beside the owner too
        assert tier.tags()[key(9)] == b"tag-9"
        assert read_tags(path, FP)[key(7)] == b"tag-7"
        assert tier.get(key(7)) == bytes([7]) * BLOCK


def test_evicted_records_take_their_tags_along(tmp_path: Path) -> None:
    path = tmp_path / "t"
    with open_tier(path, capacity=16 * (BLOCK + 8192)) as tier:
        for i in range(64):
            assert tier.put(key(i), bytes([i % 251]) * BLOCK, tag=b"t%d" % i)
            assert tier.flush()
        held = set(tier.keys())
        assert 0 < len(held) < 64
        assert set(tier.tags()) == held  # no tag outlives its record


def test_index_without_tags_reads_as_none(tmp_path: Path) -> None:
    """An index written before tags existed: no ``tag`` database; reads give none, writes
    create it."""
    path = tmp_path / "t"
    with open_tier(path) as tier:
        assert tier.put(key(1), b"x" * BLOCK)
        assert tier.flush()
    env = lmdb.open(str(path), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"tag", txn=txn), delete=True)
    env.close()
    assert read_tags(path, FP) == {}
    assert read_keys(path, FP) == [key(1)]
    with open_tier(path) as tier:
        assert tier.tags() == {}
        assert tier.put(key(2), b"y" * BLOCK, tag=b"new")
        assert tier.flush()
        assert tier.tags() == {key(2): b"new"}


def test_bad_tag_is_refused_naming_it(tmp_path: Path) -> None:
    with open_tier(tmp_path / "t") as tier:
        with pytest.raises(ValueError, match="tag: expected bytes of at most"):
            tier.put(key(1), b"x" * BLOCK, tag=b"x" * (MAX_TAG_LEN + 1))
        with pytest.raises(ValueError, match="tag: "):
            tier.put(key(1), b"x" * BLOCK, tag="text")  # type: ignore[arg-type]
        assert key(1) not in tier
