"""The SSD tier's index on its own: a real LMDB environment in a temporary directory."""

from __future__ import annotations

from pathlib import Path

import lmdb
import pytest

from kvstrata.tiers.ssd.index import Index, IndexFailure, MapFull, WriteTxn
from kvstrata.tiers.ssd.record import CLOCK, Codec, Encoded, Header, record_footprint

MiB = 1024**2
NS = b"N" * 16
OTHER = b"O" * 16
CODEC = Codec("none")


def key(i: int, ns: bytes = NS) -> bytes:
    return ns + i.to_bytes(32, "big")


def record(i: int, page: int, size: int = 8192, ns: bytes = NS) -> Encoded:
    e = Encoded(key(i, ns), bytes([i % 256]) * size, CODEC)
    e.header = e.header.at_page(page)
    return e


def open_index(path: Path, map_size: int = 16 * MiB) -> Index:
    index = Index(path, map_size)
    index.open_dbs()
    return index


def insert(index: Index, *records: Encoded) -> None:
    with index.write() as tx:
        for e in records:
            tx.insert(e)


@pytest.fixture
def index(tmp_path: Path):
    index = open_index(tmp_path)
    yield index
    index.close()


def test_insert_keeps_used_bytes_and_lru_order(index):
    insert(index, record(0, 0), record(1, 2), record(2, 4, ns=OTHER), record(3, 6))
    assert index.keys_lru(NS) == [key(0), key(1), key(3)]
    assert index.keys_lru(OTHER) == [key(2, OTHER)]
    assert index.used_bytes() == 4 * record_footprint(48, 8192)
    hdr = index.head(key(1))
    assert hdr is not None and (hdr.page, hdr.pages, hdr.clock) == (2, 2, 2)
    assert index.has(key(3)) and not index.has(key(9)) and index.head(key(9)) is None


def test_retouch_moves_a_record_to_the_recent_end(index):
    insert(index, record(0, 0), record(1, 2), record(2, 4))
    with index.write() as tx:
        tx.retouch(key(0))
        tx.retouch(key(9))                # absent: nothing
    assert index.keys_lru(NS) == [key(1), key(2), key(0)]
    hdr = index.head(key(0))
    assert hdr is not None and hdr.clock == 4 and hdr.page == 0


def test_evict_removes_least_recently_used_first_and_frees_their_pages(index):
    fp = record_footprint(48, 8192)
    insert(index, *(record(i, 2 * i) for i in range(5)))
    with index.write() as tx:
        tx.retouch(key(0))
        evicted = tx.evict(target=3 * fp)
        assert evicted == [key(1), key(2)] and tx.used == 3 * fp
        assert sorted(tx.freed) == [(2, 2), (4, 2)]
        assert tx.evict(target=3 * fp) == []
    assert index.keys_lru(NS) == [key(3), key(4), key(0)]
    assert index.used_bytes() == 3 * fp


def test_delete_returns_the_footprint_and_frees_the_pages(index):
    insert(index, record(0, 0), record(1, 2, size=100))  # record 1 lives in the index alone
    with index.write() as tx:
        assert tx.delete(key(0)) == record_footprint(48, 8192)
        assert tx.delete(key(1)) == record_footprint(48, 100)
        assert tx.delete(key(1)) == 0
        assert tx.freed == [(0, 2)]
    assert index.keys_lru(NS) == [] and index.used_bytes() == 0


def test_an_aborted_transaction_changes_nothing(index):
    insert(index, record(0, 0))
    with pytest.raises(RuntimeError):
        with index.write() as tx:
            tx.delete(key(0))
            tx.insert(record(1, 2))
            raise RuntimeError("the page write failed")
    assert index.keys_lru(NS) == [key(0)] and index.used_bytes() == record_footprint(48, 8192)


def test_state_and_order_survive_reopening(tmp_path):
    index = open_index(tmp_path)
    insert(index, record(0, 0), record(1, 2))
    with index.write() as tx:
        tx.retouch(key(0))
    index.sync()
    index.close()
    index = open_index(tmp_path)
    insert(index, record(2, 4))
    assert index.keys_lru(NS) == [key(1), key(0), key(2)]
    hdr = index.head(key(2))
    assert hdr is not None and hdr.clock == 4        # the clock continued
    assert index.used_bytes() == 3 * record_footprint(48, 8192)
    index.close()


def add_lru_entry(path: Path, clock: int, nskey: bytes) -> None:
    """An LRU entry no head matches, as a head that did not verify leaves behind."""
    env = lmdb.open(str(path), max_dbs=8, map_size=16 * MiB)
    with env.begin(write=True) as txn:
        txn.put(CLOCK.pack(clock), nskey, db=env.open_db(b"lru", txn=txn))
    env.close()


def test_stale_lru_entries_are_neither_listed_nor_evicting(tmp_path):
    index = open_index(tmp_path)
    insert(index, record(0, 0), record(1, 2), record(2, 4))  # clocks 1, 2, 3
    with index.write() as tx:
        tx.delete(key(0))
    index.close()
    add_lru_entry(tmp_path, 1, key(2))   # stale: record 2 lives at clock 3
    add_lru_entry(tmp_path, 0, key(7))   # stale: no record 7
    index = open_index(tmp_path)
    assert index.keys_lru(NS) == [key(1), key(2)]
    fp = record_footprint(48, 8192)
    with index.write() as tx:
        assert tx.evict(target=fp) == [key(1)]      # not record 2 through its stale entry
    assert index.keys_lru(NS) == [key(2)] and index.used_bytes() == fp
    index.close()


def test_drop_removes_head_and_lru_entry_without_accounting(index):
    insert(index, record(0, 0), record(1, 2))
    with index.write() as tx:
        tx.drop(key(0))
        assert tx.freed == [] and tx.used == 2 * record_footprint(48, 8192)
        assert [k for k, _ in tx.heads()] == [key(1)]
    assert index.keys_lru(NS) == [key(1)]


def test_meta_records_and_drop_all(index):
    insert(index, record(0, 0), record(1, 2))
    with index.write() as tx:
        assert tx.meta(b"kvstrata") is None and tx.records() == 2
        tx.put_meta(b"kvstrata", b"x")
        tx.drop_all()
        assert tx.records() == 0 and (tx.used, tx.clock) == (0, 0)
    with index.write() as tx:
        assert tx.meta(b"kvstrata") == b"x"
    assert index.keys_lru(NS) == [] and index.used_bytes() == 0


def test_a_full_map_raises_map_full_and_leaves_the_index_usable(tmp_path):
    index = open_index(tmp_path, map_size=256 * 1024)
    with pytest.raises(MapFull):
        with index.write() as tx:
            for i in range(10_000):
                tx.insert(record(i, i, size=1000))      # 1000-byte payloads: in the index
    assert issubclass(MapFull, IndexFailure) and index.used_bytes() == 0
    insert(index, record(0, 0, size=1000))
    assert index.keys_lru(NS) == [key(0)]
    index.close()


def test_lmdb_errors_become_index_failures(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(IndexFailure):
        Index(tmp_path / "file", MiB)
    index = open_index(tmp_path / "env")
    index.close()
    with pytest.raises(IndexFailure):
        index.keys_lru(NS)
    assert index.has(key(0)) is False               # a failed read is a miss
    assert index.used_bytes() == 0


def test_write_txn_starts_from_the_state_record(index):
    insert(index, record(0, 0))
    with index.write() as tx:
        assert isinstance(tx, WriteTxn)
        assert (tx.used, tx.clock) == (record_footprint(48, 8192), 1)
        assert Header.unpack(dict(tx.heads())[key(0)]).clock == 1
