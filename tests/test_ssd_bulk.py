"""The SSD tier's bulk paths against plain one-record-at-a-time references: the survey of
every head recovery makes, the free-space map built from arrays, the keys a child sends
back in one buffer, and a write batch's page placement and page writes (real LMDB and
page file in a temporary directory, the writer's turn run on the test's thread)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.tiers.ssd.coders import Coders
from kvstrata.tiers.ssd.extents import ExtentMap
from kvstrata.tiers.ssd.health import Health
from kvstrata.tiers.ssd.beside import pack_keys, unpack_keys
from kvstrata.tiers.ssd.index import parse_head
from kvstrata.tiers.ssd.lost import LostKeys
from kvstrata.tiers.ssd.reclaim import Reclaim
from kvstrata.tiers.ssd.record import PAGE, Codec, Encoded, record_footprint
from kvstrata.tiers.ssd.directory import prepare_directory
from kvstrata.tiers.ssd.recovery import open_files
from kvstrata.tiers.ssd.survey import Survey, survey
from kvstrata.tiers.ssd.tier import SSDTier, read_keys
from kvstrata.tiers.ssd.writequeue import WriteQueue
from kvstrata.tiers.ssd.writer import Writer

MiB = 1024**2
NS = b"N" * 16


# ====================================================================== the survey

def reference_survey(heads: list[tuple[bytes, bytes]], size: int) -> tuple[dict, list]:
    """One head at a time: good ones (key -> page, pages, footprint) and bad keys."""
    good, bad = {}, []
    for nskey, head in heads:
        hdr = parse_head(head)
        body = 0 if hdr is None else hdr.payload_len - hdr.tail_len
        if hdr is None or (body and hdr.page * PAGE + body > size):
            bad.append(nskey)
        else:
            good[nskey] = (hdr.page, hdr.pages, record_footprint(len(nskey), hdr.payload_len))
    owner: dict = {}
    for nskey, (p, n, _) in sorted(good.items()):
        if n and owner.setdefault((p, n), nskey) != nskey:
            bad.append(nskey)
            del good[nskey]
    for extent in ExtentMap.overlapping(owner):
        bad.append(owner[extent])
        del good[owner[extent]]
    return good, bad


def random_heads(rng: random.Random) -> list[tuple[bytes, bytes]]:
    codec = Codec("none")
    keys = sorted({bytes([rng.randrange(3)]) * 16 + rng.randbytes(rng.choice([4, 32]))
                   for _ in range(rng.randrange(0, 14))})
    heads = []
    for key in keys:
        e = Encoded(key, rng.randbytes(rng.choice([100, 4096, 5000, 8192, 20000])), codec)
        e.page = rng.randrange(0, 24)
        head = e.head(rng.randrange(100))
        if rng.random() < 0.1:
            head = head[:-1]
        if rng.random() < 0.1:
            head = bytes([head[0] ^ 1]) + head[1:]
        heads.append((key, head))
    return heads


@pytest.mark.parametrize("seed", range(40))
def test_the_survey_matches_one_head_at_a_time(seed):
    rng = random.Random(seed)
    for _ in range(25):
        heads = random_heads(rng)
        size = rng.randrange(0, 30) * PAGE
        good, bad = reference_survey(heads, size)
        found = survey([key for key, _ in heads], [head for _, head in heads], size)
        assert sorted(found.bad) == sorted(bad)
        assert found.used == sum(fp for _, _, fp in good.values())
        assert sorted(zip(found.starts.tolist(), found.npages.tolist())) == \
            sorted((p, n) for p, n, _ in good.values() if n)
        counts: dict[bytes, int] = {}
        for key in good:
            counts[key[:16]] = counts.get(key[:16], 0) + 1
        assert found.counts == counts


def test_a_survey_packs_and_refuses_garbage():
    heads = random_heads(random.Random(7))
    found = survey([key for key, _ in heads], [head for _, head in heads], 1 << 30)
    again = Survey.unpack(found.pack())
    assert again.bad == found.bad and again.used == found.used and again.counts == found.counts
    assert again.starts.tolist() == found.starts.tolist()
    with pytest.raises(ValueError, match="not a survey"):
        Survey.unpack(b"\x93garbage")


# ====================================================================== the free-space map

@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 80), st.integers(0, 9)), max_size=30),
       st.integers(0, 96))
def test_bulk_maps_equal_the_map_built_one_extent_at_a_time(extents, limit):
    used, end = [], 0
    for start, n in sorted(extents):  # make them disjoint, as the survey leaves them
        if start >= end:
            used.append((start, n))
            end = start + n
    ref = ExtentMap(limit, used)
    bulk = ExtentMap.from_used(limit, np.array([p for p, _ in used], np.int64)[::-1],
                               np.array([n for _, n in used], np.int64)[::-1])
    starts, npages = ref.free_extents()
    again = ExtentMap.from_free(limit, starts, npages, ref.high_water)
    for m in (bulk, again):
        assert [a.tolist() for a in m.free_extents()] == [starts.tolist(), npages.tolist()]
        assert m.free_pages == ref.free_pages and m.largest() == ref.largest()
        assert m.high_water == ref.high_water
    for n in (1, 3, 1, 2, 5):  # and they go on alike
        assert len({m.allocate(n) is None for m in (ref, bulk, again)}) == 1
        assert ref.free_pages == bulk.free_pages == again.free_pages


# ====================================================================== keys in one buffer

def test_keys_pack_and_unpack_in_order_whatever_their_lengths():
    same = [NS + bytes([i]) * 32 for i in range(5)]
    mixed = [NS + b"x" * n for n in (0, 1, 32, 495, 7)]
    for keys in (same, mixed, []):
        assert unpack_keys(pack_keys(keys, 16)) == [key[16:] for key in keys]
    for bad in (b"", b"\x05" + bytes(7), pack_keys(same, 16)[:-1]):
        with pytest.raises(ValueError):
            unpack_keys(bad)


def test_read_keys_sends_keys_of_any_length_in_lru_order(tmp_path):
    keys = [b"k" * n for n in (1, 32, 300, 33, 5)] + [bytes([i]) * 32 for i in range(40)]
    with SSDTier(tmp_path / "ssd", capacity_bytes=16 * MiB, fingerprint="fp",
                 compression="none") as tier:
        for key in keys:
            assert tier.put(key, bytes(1000))
            assert tier.flush()
        tier.touch_many([keys[2], keys[0]])
        assert tier.flush()
        order = [key for key in keys if key not in (keys[0], keys[2])] + [keys[2], keys[0]]
        assert list(tier.keys()) == order
        assert read_keys(tmp_path / "ssd", "fp") == order
        assert read_keys(tmp_path / "ssd", "another") == []


# ====================================================================== a write batch

class Turn:
    """A tier's files and a writer whose turns run on the caller's thread."""

    def __init__(self, path: Path, map_size: int) -> None:  # evicts nothing
        self.health = Health(path)
        self.queue = WriteQueue(64 * MiB, 64 * MiB, LostKeys(NS))
        prepare_directory(path)
        files = open_files(path, map_size=map_size, namespace=NS, about={},
                           health=self.health, lost=self.queue.lost)
        assert files is not None
        self.files = files
        self.writer = Writer(files=files, reclaim=Reclaim(), queue=self.queue,
                             codec=Codec("none"), coders=Coders(False), health=self.health,
                             capacity_bytes=1 << 40, name="unused")

    def write(self, blocks: dict[bytes, bytes]) -> None:
        for key, data in blocks.items():
            assert self.queue.put(key, data)
        work = self.queue.next_work(0, 0)
        assert len(work.batch) == len(blocks)
        assert self.writer._write_safely(work, sync=True)
        self.queue.finish(work)

    def discard(self, keys: list[bytes]) -> None:
        self.queue.discard(keys)
        work = self.queue.next_work(0, 0)
        assert self.writer._write_safely(work, sync=True)
        self.queue.finish(work)

    def pages(self, key: bytes) -> tuple[int, int]:
        hdr = self.files.index.head(key)
        assert hdr is not None
        return hdr.page, hdr.pages

    def read(self, key: bytes) -> bytes:
        page, pages = self.pages(key)
        return self.files.pages.read(page, pages * PAGE)


def key(i: int) -> bytes:
    return NS + i.to_bytes(32, "big")


def data(i: int, n: int = 4 * PAGE) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_a_batch_takes_one_extent_and_one_write_when_it_fits(tmp_path, monkeypatch):
    turn = Turn(tmp_path / "ssd", 4 * MiB)
    calls = []
    real = turn.files.pages.write_run
    monkeypatch.setattr(turn.files.pages, "write_run",
                        lambda page, bodies: calls.append((page, len(bodies))) or real(page, bodies))
    turn.write({key(i): data(i) for i in range(10)})
    assert calls == [(0, 10)]
    assert [turn.pages(key(i)) for i in range(10)] == [(4 * i, 4) for i in range(10)]
    assert all(turn.read(key(i)) == data(i) for i in range(10))


def test_a_batch_fills_scattered_holes_one_record_each(tmp_path, monkeypatch):
    turn = Turn(tmp_path / "ssd", 64 * PAGE)    # 16 records of 4 pages fill the file
    for i in range(16):
        turn.write({key(i): data(i)})
    turn.discard([key(i) for i in range(0, 16, 2)])
    turn.discard([])                             # a sync more: the holes are free now
    calls = []
    real = turn.files.pages.write_run
    monkeypatch.setattr(turn.files.pages, "write_run",
                        lambda page, bodies: calls.append((page, len(bodies))) or real(page, bodies))
    turn.write({key(100 + i): data(100 + i) for i in range(8)})
    assert sorted(calls) == [(8 * i, 1) for i in range(8)]   # no extent holds all 32 pages
    taken = sorted(turn.pages(key(100 + i)) for i in range(8))
    assert taken == [(8 * i, 4) for i in range(8)]
    assert all(turn.read(key(i)) == data(i) for i in list(range(100, 108)) + list(range(1, 16, 2)))
    assert turn.health.snapshot()["dropped_no_room"] == 0


def test_bodies_that_end_inside_a_page_are_padded_to_it(tmp_path):
    turn = Turn(tmp_path / "ssd", 4 * MiB)
    sizes = [PAGE + 2000, 3 * PAGE + 1500, 10, PAGE]  # tails over 1 KiB stay in the body
    turn.write({key(i): data(i, n) for i, n in enumerate(sizes)})
    pages = [turn.pages(key(i)) for i in range(len(sizes)) if sizes[i] > 1024]
    assert pages == [(0, 2), (2, 4), (6, 1)]
    raw = turn.files.pages.read(0, 7 * PAGE)
    assert raw[:sizes[0]] == data(0, sizes[0]) and raw[sizes[0]:2 * PAGE] == bytes(2 * PAGE - sizes[0])
    assert raw[2 * PAGE:2 * PAGE + sizes[1]] == data(1, sizes[1])
    assert raw[6 * PAGE:] == data(3, PAGE)
