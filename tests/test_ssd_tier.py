"""The SSD tier end to end, through SSDTier alone: real LMDB environments and page files in
temporary directories, real processes (nothing mocked). Its parts have their own tests:
test_ssd_record, test_extents, test_ssd_reclaim, test_ssd_index, test_ssd_writer."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

import ssd_helper
from kvstrata.errors import ConfigError
from kvstrata.tiers.ssd import SSDTier, capacity_blocks, record_footprint
from kvstrata.tiers.ssd import coders

HELPER = str(Path(__file__).with_name("ssd_helper.py"))
ROOT = str(Path(__file__).resolve().parents[1])
MiB = 1024**2
FP = "model-a/fp16/bs16"


def k(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


def kv_like(nbytes: int, seed: int = 0) -> bytes:
    """fp16 values with the spread of projected activations (not uniform bytes)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(nbytes // 2) * 0.7).astype(np.float16).tobytes()


def rand(nbytes: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def helper(*args: object, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, HELPER, *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path / "ssd"


@contextmanager
def writer_stalled(tier: SSDTier) -> Iterator[None]:
    """Another process holds the environment's writer lock: the tier's writer thread
    blocks at its next transaction until the block exits."""
    proc = subprocess.Popen([sys.executable, HELPER, "hold", str(tier.path),
                             str(tier.capacity_bytes + tier.slack_bytes)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0


# ---------------------------------------------------------------------- round trips

SIZES = [1, 17, 4079, 4080, 4096, 65520, 65536, 65537, 100_000, 2 * MiB + 6]


@pytest.mark.parametrize("compression", ["none", "zstd", "auto"])
def test_round_trip_exact_bytes_for_many_sizes(tmp, compression):
    blocks = {k(i): (kv_like if i % 2 else rand)(n, i) for i, n in enumerate(SIZES)}
    with SSDTier(tmp, capacity_bytes=64 * MiB, fingerprint=FP, compression=compression) as tier:
        for key, data in blocks.items():
            assert tier.put(key, data)
        assert all(tier.get(key) == data for key, data in blocks.items())  # queued or written
        assert tier.flush()
        assert tier.get_many(list(blocks)) == list(blocks.values())
        assert sorted(tier.keys()) == sorted(blocks)
        assert all(key in tier for key in blocks) and k(999) not in tier
        assert tier.get(k(999)) is None
    with SSDTier(tmp, capacity_bytes=64 * MiB, fingerprint=FP, compression=compression) as tier:
        assert tier.get_many(list(blocks)) == list(blocks.values())
        assert tier.stats()["hits"] == len(blocks)


def test_accepts_arrays_and_tensors_and_copies_them(tmp):
    import torch
    arr = np.arange(4096, dtype=np.uint16)
    ten = torch.arange(2048, dtype=torch.float16)
    with SSDTier(tmp, capacity_bytes=4 * MiB, fingerprint=FP) as tier:
        tier.put(k(0), arr)
        tier.put(k(1), ten)
        expect0, expect1 = arr.tobytes(), ten.numpy().tobytes()
        arr[:] = 0
        ten.zero_()
        tier.flush()
        assert tier.get(k(0)) == expect0 and tier.get(k(1)) == expect1


def test_raw_64k_block_takes_16_pages_and_bodies_are_page_aligned(tmp):
    with SSDTier(tmp, capacity_bytes=64 * MiB, fingerprint=FP, compression="none") as tier:
        tier.put(k(0), rand(65536))
        tier.flush()
        before = tier.stats()
        for i in range(1, 65):
            tier.put(k(i), rand(65536, i))
        tier.flush()
        after = tier.stats()
    assert after["block_file_bytes"] - before["block_file_bytes"] == 64 * 16 * 4096
    assert after["index_file_bytes"] < 64 * 4096  # the index holds ~200 bytes per record
    blocks = (tmp / "blocks.dat").read_bytes()
    found = sorted(blocks.index(rand(65536, i)) for i in range(65))
    assert found == [i * 65536 for i in range(65)]  # every body at a page boundary, no gaps


def test_small_payload_lives_in_the_index_and_tail_saves_a_page(tmp):
    with SSDTier(tmp, capacity_bytes=64 * MiB, fingerprint=FP, compression="none") as tier:
        tier.put(k(0), rand(1000))           # all of it in the head record
        tier.put(k(1), rand(65536 + 500, 1))  # 16 pages + a 500-byte tail in the head
        tier.flush()
        assert tier.stats()["block_file_bytes"] == 16 * 4096
        assert tier.get(k(0)) == rand(1000) and tier.get(k(1)) == rand(65536 + 500, 1)
    assert record_footprint(48, 1000) < 4096 < record_footprint(48, 4096) < 2 * 4096


@pytest.mark.parametrize("compression", ["none", "auto"])
def test_get_into_fills_caller_buffers(tmp, compression):
    sizes = [65536, 65536 + 500, 1000]  # whole pages, pages + tail, tail only
    with SSDTier(tmp, capacity_bytes=16 * MiB, fingerprint=FP, compression=compression) as tier:
        for i, n in enumerate(sizes):
            tier.put(k(i), kv_like(n, i))
        pending = [bytearray(n) for n in sizes]
        assert tier.get_into([k(i) for i in range(3)], pending) == [True] * 3  # queued or written
        assert [bytes(b) for b in pending] == [kv_like(n, i) for i, n in enumerate(sizes)]
        tier.flush()
        rows = np.zeros((2, 65536), dtype=np.uint8)
        assert tier.get_into([k(0), k(9)], list(rows)) == [True, False]
        assert rows[0].tobytes() == kv_like(65536, 0) and not rows[1].any()
        wrong_size = bytearray(65536)
        assert tier.get_into([k(1)], [wrong_size]) == [False]
        with pytest.raises(ValueError, match="^outs"):
            tier.get_into([k(0)], [bytes(65536)])
        with pytest.raises(ValueError, match="^outs"):
            tier.get_into([k(0), k(1)], [bytearray(65536)])
        s = tier.stats()
        assert s["hits"] == 4 and s["misses"] == 2


def test_get_into_verifies_in_place(tmp):
    with SSDTier(tmp, capacity_bytes=4 * MiB, fingerprint=FP, compression="none") as tier:
        tier.put(k(0), rand(65536))
        tier.put(k(1), rand(65536, 1))
        tier.flush()
        with open(tmp / "blocks.dat", "r+b") as f:  # records are laid out in put order
            f.seek(777)
            byte = f.read(1)[0]
            f.seek(777)
            f.write(bytes([byte ^ 1]))
        bufs = [bytearray(65536), bytearray(65536)]
        assert tier.get_into([k(0), k(1)], bufs) == [False, True]
        assert bytes(bufs[1]) == rand(65536, 1)
        tier.flush()
        assert tier.stats()["corrupt_deleted"] == tier.counts()["corrupt_deleted"] == 1 and k(0) not in tier


def codec_threads() -> int:
    return sum(t.name.startswith("kvstrata-ssd-codec") for t in threading.enumerate())


def test_batches_compress_and_decompress_on_several_threads(tmp, monkeypatch):
    monkeypatch.setattr(coders, "CODER_THREADS", 3)
    blocks = {k(i): kv_like(65536, i) if i % 4 else rand(65536, i) for i in range(48)}
    with SSDTier(tmp, capacity_bytes=32 * MiB, fingerprint=FP, compression="auto") as tier:
        before = codec_threads()
        with writer_stalled(tier):  # the puts form big batches
            for key, data in blocks.items():
                assert tier.put(key, data)
        assert tier.flush()
        assert codec_threads() - before == 3 and tier.stats()["batches_committed"] < 24
        assert tier.get_many(list(blocks)) == list(blocks.values())
        rows = np.zeros((len(blocks), 65536), dtype=np.uint8)
        assert tier.get_into(list(blocks), list(rows)) == [True] * len(blocks)
        assert [r.tobytes() for r in rows] == list(blocks.values())
        assert tier.stats()["compression_ratio"] > 1.05


def test_put_of_stored_key_is_a_no_op(tmp):
    with SSDTier(tmp, capacity_bytes=4 * MiB, fingerprint=FP) as tier:
        tier.put(k(0), rand(1000))
        tier.flush()
        assert tier.put(k(0), rand(1000, 1))
        tier.flush()
        s = tier.stats()
        assert s["blocks_written"] == 1 and s["puts_present"] == 1
        assert tier.get(k(0)) == rand(1000)


# ---------------------------------------------------------------------- persistence

def test_warm_restart_in_a_new_process(tmp):
    out = helper("write", tmp, 30, 7)
    assert out.returncode == 0, out.stderr
    with SSDTier(tmp, capacity_bytes=ssd_helper.CAPACITY, fingerprint=ssd_helper.FINGERPRINT) as t:
        for i in range(30):
            assert t.get(ssd_helper.key_of(7, i)) == ssd_helper.block_of(7, i), i


def test_other_fingerprint_sees_none_of_the_blocks(tmp):
    with SSDTier(tmp, capacity_bytes=8 * MiB, fingerprint=FP) as tier:
        for i in range(5):
            tier.put(k(i), rand(5000, i))
    with SSDTier(tmp, capacity_bytes=8 * MiB, fingerprint=b"model-b/fp16/bs16") as other:
        assert other.get_many([k(i) for i in range(5)]) == [None] * 5
        assert list(other.keys()) == [] and k(0) not in other
        other.put(k(0), rand(5000, 99))
    with SSDTier(tmp, capacity_bytes=8 * MiB, fingerprint=FP) as tier:
        assert tier.get(k(0)) == rand(5000, 0)
        assert len(list(tier.keys())) == 5


# ---------------------------------------------------------------------- capacity and LRU

def fill(tier: SSDTier, ids: range, size: int = 65536) -> None:
    for i in ids:
        tier.put(k(i), rand(size, i))
        tier.flush()  # one block per transaction: a deterministic recency order


def test_capacity_bound_and_lru_eviction_order(tmp):
    cap = 2 * MiB
    fp = record_footprint(32 + 16, 65536)
    fits = cap // fp
    with SSDTier(tmp, capacity_bytes=cap, fingerprint=FP, compression="none") as tier:
        fill(tier, range(40))
        present = [i for i in range(40) if k(i) in tier]
        assert present == list(range(40 - fits, 40))
        oldest = present[0]
        assert tier.get(k(oldest)) is not None  # now most recently used
        tier.flush()                            # recency persisted in a batch
        fill(tier, range(40, 41))
        assert k(oldest) in tier and k(oldest + 1) not in tier
        s = tier.stats()
        assert s["current_bytes"] <= cap and s["evictions"] == 40 + 1 - fits
    with SSDTier(tmp, capacity_bytes=cap, fingerprint=FP, compression="none") as tier:
        fill(tier, range(41, 42))               # recency survived the restart
        assert k(oldest) in tier and k(oldest + 2) not in tier


def test_data_file_stays_within_capacity_plus_slack(tmp):
    cap = 8 * MiB
    rng = np.random.default_rng(3)
    with SSDTier(tmp, capacity_bytes=cap, fingerprint=FP) as tier:
        for i in range(400):  # ~6x the capacity, mixed sizes and codecs
            n = int(rng.integers(1, 5)) * 16384
            tier.put(k(i), kv_like(n, i) if i % 3 else rand(n, i))
            if i % 10 == 9:
                tier.flush()
        tier.flush()
        s = tier.stats()
        assert s["current_bytes"] <= cap
        assert s["file_bytes"] <= cap + tier.slack_bytes, (s["file_bytes"], tier.slack_bytes)
        assert s["block_file_bytes"] > cap // 2
        assert s["evictions"] > 0 and s["dropped_write_error"] == 0
        assert all(tier.get(k(i)) == (kv_like if i % 3 else rand)(len(tier.get(k(i))), i)
                   for i in range(380, 400))


def test_reopen_with_smaller_capacity_evicts_down(tmp):
    with SSDTier(tmp, capacity_bytes=8 * MiB, fingerprint=FP, compression="none") as tier:
        fill(tier, range(60))
    with SSDTier(tmp, capacity_bytes=2 * MiB, fingerprint=FP, compression="none") as tier:
        tier.put(k(100), rand(65536, 100))
        tier.flush()
        assert tier.stats()["current_bytes"] <= 2 * MiB
        assert k(100) in tier and k(59) in tier and k(0) not in tier


# ---------------------------------------------------------------------- compression

def test_auto_stores_random_bytes_raw_and_compresses_kv(tmp):
    with SSDTier(tmp, capacity_bytes=16 * MiB, fingerprint=FP) as tier:
        for i in range(4):
            tier.put(k(i), rand(65536, i))
        tier.flush()
        s = tier.stats()
        assert s["bytes_stored"] == s["bytes_raw"] and s["compression_ratio"] == 1.0
        for i in range(4, 8):
            tier.put(k(i), kv_like(65536, i))
        tier.flush()
        assert tier.stats()["compression_ratio"] > 1.05


# ---------------------------------------------------------------------- integrity

def test_corrupt_record_is_deleted_counted_and_missed(tmp, caplog):
    with SSDTier(tmp, capacity_bytes=4 * MiB, fingerprint=FP) as tier:
        tier.put(k(0), rand(20000))
        tier.put(k(1), rand(20000, 1))
        tier.flush()
        at = (tmp / "blocks.dat").read_bytes().index(rand(20000)[:4096])  # stored raw
        with open(tmp / "blocks.dat", "r+b") as f:  # damage the stored payload in place
            f.seek(at + 1234)
            byte = f.read(1)[0]
            f.seek(at + 1234)
            f.write(bytes([byte ^ 0x40]))
        with caplog.at_level(logging.WARNING):
            assert tier.get(k(0)) is None
            assert tier.get(k(0)) is None
        assert tier.get(k(1)) == rand(20000, 1)
        tier.flush()
        s = tier.stats()
        assert s["corrupt_deleted"] == 1 and s["misses"] == 2
        assert list(tier.keys()) == [k(1)]
        assert tier.take_lost() == [k(0)]  # deleted by the tier: its owner must hear of it
        assert sum("does not verify" in r.message for r in caplog.records) == 1


def test_sigkill_mid_stream_leaves_only_exact_blocks(tmp):
    proc = subprocess.Popen([sys.executable, HELPER, "stream", str(tmp), "11"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})
    flushed = 0
    deadline = time.monotonic() + 30
    while flushed < 64 and time.monotonic() < deadline:
        flushed = int(proc.stdout.readline() or 0)
    time.sleep(0.05)  # let it get into the middle of further puts
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert flushed >= 64, proc.stderr.read()
    out = helper("check", tmp, flushed + 64, 11)
    assert out.returncode == 0, out.stdout + out.stderr
    res = json.loads(out.stdout)
    assert res["wrong"] == []
    assert set(range(flushed)) <= set(res["hits"])  # every flushed block survived


@pytest.mark.parametrize("seed,name", [(1, "data.mdb"), (2, "data.mdb"), (3, "data.mdb"),
                                       (4, "blocks.dat"), (5, "blocks.dat")])
def test_random_byte_flips_never_return_wrong_data(tmp, seed, name):
    assert helper("write", tmp, 120, seed).returncode == 0
    data = tmp / name
    size = data.stat().st_size
    rng = np.random.default_rng(seed)
    with open(data, "r+b") as f:
        for off in rng.integers(0, size, 300):
            f.seek(int(off))
            b = f.read(1)
            f.seek(int(off))
            f.write(bytes([b[0] ^ int(rng.integers(1, 256))]))
    out = helper("check", tmp, 120, seed)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    res = json.loads(out.stdout)
    assert res["wrong"] == []
    s = res["stats"]
    assert s["corrupt_deleted"] > 0 or not s["available"] or s["read_errors"], s


def test_garbage_environment_degrades_to_misses(tmp, caplog):
    """A tier's index overwritten with garbage (the tier's lock file says it is one)."""
    with SSDTier(tmp, capacity_bytes=4 * MiB, fingerprint=FP) as tier:
        fill(tier, range(3))
    (tmp / "data.mdb").write_bytes(os.urandom(64 * 1024))
    with caplog.at_level(logging.ERROR):
        tier = SSDTier(tmp, capacity_bytes=4 * MiB, fingerprint=FP)
        assert tier.get(k(0)) is None and tier.put(k(0), rand(100)) is False
        assert k(0) not in tier and list(tier.keys()) == [] and tier.flush() is False
        tier.close()
    assert sum(str(tmp) in r.getMessage() for r in caplog.records) == 1


def test_garbage_alone_is_refused_untouched(tmp):
    """Nothing says a directory holding only an unreadable data.mdb is a tier's."""
    tmp.mkdir(mode=0o750)
    junk = os.urandom(64 * 1024)
    (tmp / "data.mdb").write_bytes(junk)
    (tmp / "data.mdb").chmod(0o640)
    with pytest.raises(ConfigError, match=r"^path: .*data.mdb cannot be read .*MDB_INVALID"):
        SSDTier(tmp, capacity_bytes=4 * MiB, fingerprint=FP)
    assert sorted(p.name for p in tmp.iterdir()) == ["data.mdb"]
    assert (tmp / "data.mdb").read_bytes() == junk
    assert (tmp.stat().st_mode & 0o777, (tmp / "data.mdb").stat().st_mode & 0o777) == (0o750, 0o640)


def test_truncated_environment_degrades_to_misses(tmp):
    with SSDTier(tmp, capacity_bytes=8 * MiB, fingerprint=FP) as tier:
        fill(tier, range(20))
    data = tmp / "data.mdb"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    with SSDTier(tmp, capacity_bytes=8 * MiB, fingerprint=FP) as tier:
        assert tier.get_many([k(i) for i in range(20)]) == [None] * 20
        assert not tier.stats()["available"]


def test_truncated_block_file_costs_only_the_cut_records(tmp):
    with SSDTier(tmp, capacity_bytes=8 * MiB, fingerprint=FP, compression="none") as tier:
        fill(tier, range(20))
    blocks = tmp / "blocks.dat"
    with open(blocks, "r+b") as f:
        f.truncate(10 * 65536 + 100)  # cuts record 10 short; 11-19 are gone entirely
    with SSDTier(tmp, capacity_bytes=8 * MiB, fingerprint=FP, compression="none") as tier:
        got = tier.get_many([k(i) for i in range(20)])
        assert got[:10] == [rand(65536, i) for i in range(10)]
        assert got[10:] == [None] * 10
        s = tier.stats()
        assert s["available"] and s["corrupt_deleted"] == 10
        assert sorted(tier.take_lost()) == sorted(k(i) for i in range(10, 20))
        assert s["block_file_bytes"] == 10 * 65536  # the torn tail is cut off at open
        fill(tier, range(20, 25))                    # and its pages are reused
        assert s["current_bytes"] == 10 * record_footprint(48, 65536)
        assert tier.get_many([k(i) for i in range(20, 25)]) == [rand(65536, i)
                                                                 for i in range(20, 25)]
        assert tier.stats()["block_file_bytes"] == 15 * 65536


def test_concurrent_reads_during_heavy_eviction_see_exact_bytes(tmp):
    errors: list[BaseException] = []
    stop = threading.Event()
    with SSDTier(tmp, capacity_bytes=MiB, fingerprint=FP, compression="none") as tier:
        def reader() -> None:
            try:
                while not stop.is_set():
                    for i in range(0, 400, 3):
                        got = tier.get(k(i))
                        assert got is None or got == rand(16384, i), i
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        for i in range(400):                         # ~6x the capacity
            tier.put(k(i), rand(16384, i))
            if i % 20 == 19:
                tier.flush()
        tier.flush()
        stop.set()
        for t in threads:
            t.join()
        s = tier.stats()
    assert not errors
    assert s["corrupt_deleted"] == 0 and s["evictions"] > 300 and s["dropped_no_room"] == 0


def test_records_of_another_fingerprint_are_reported_at_open_and_evicted_first(tmp, caplog):
    """A directory written under another fingerprint (an earlier kvstrata format version's
    namespace, another model) opens and serves the new one; the open says how many
    records it cannot serve, and they are the first the LRU evicts."""
    cap = 2 * MiB
    fits = cap // record_footprint(32 + 16, 65536)
    with SSDTier(tmp, capacity_bytes=cap, fingerprint="kvstrata/v1|model=m", compression="none") as tier:
        fill(tier, range(5))
    with caplog.at_level(logging.INFO, logger="kvstrata.tiers.ssd"):
        with SSDTier(tmp, capacity_bytes=cap, fingerprint=FP, compression="none") as tier:
            assert tier.get(k(0)) is None
            fill(tier, range(100, 100 + fits - 2))
            s = tier.stats()
            assert s["evictions"] == 3 and len(list(tier.keys())) == fits - 2
            assert all(tier.get(k(i)) == rand(65536, i) for i in range(100, 100 + fits - 2))
    said = [r.getMessage() for r in caplog.records if "other fingerprints" in r.getMessage()]
    assert len(said) == 1 and "5 of its 5 records" in said[0] and str(tmp) in said[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvstrata.tiers.ssd"):
        with SSDTier(tmp, capacity_bytes=cap, fingerprint="kvstrata/v1|model=m", compression="none") as tier:
            assert [tier.get(k(i)) is not None for i in range(5)] == [False] * 3 + [True] * 2
    assert any(f"{fits - 2} of its {fits} records" in r.getMessage() for r in caplog.records)


def test_records_of_an_older_format_are_discarded(tmp, caplog):
    import lmdb
    import msgpack
    with SSDTier(tmp, capacity_bytes=8 * MiB, fingerprint=FP) as tier:
        fill(tier, range(5))
    env = lmdb.open(str(tmp), max_dbs=8)
    with env.begin(write=True) as txn:               # as a tier of record format 1 left it
        meta = env.open_db(b"meta", txn=txn)
        txn.put(b"kvstrata", msgpack.packb({"format": 1, "created_at": 0.0}), db=meta)
        txn.put(b"k", b"v", db=env.open_db(b"body", txn=txn))
    env.close()
    with caplog.at_level(logging.WARNING):
        with SSDTier(tmp, capacity_bytes=8 * MiB, fingerprint=FP) as tier:
            assert tier.get_many([k(i) for i in range(5)]) == [None] * 5
            s = tier.stats()
            assert s["available"] and s["current_bytes"] == 0 and s["block_file_bytes"] == 0
            fill(tier, range(5, 7))
    assert any("format 1" in r.getMessage() for r in caplog.records)
    with SSDTier(tmp, capacity_bytes=8 * MiB, fingerprint=FP) as tier:
        assert tier.get(k(6)) == rand(65536, 6) and tier.get(k(0)) is None


# ---------------------------------------------------------------------- async writes

def test_full_queue_drops_and_counts_without_blocking(tmp):
    with SSDTier(tmp, capacity_bytes=16 * MiB, fingerprint=FP,
                 queue_capacity_bytes=4 * 65536) as tier:
        with writer_stalled(tier):
            t0 = time.monotonic()
            accepted = [tier.put(k(i), rand(65536, i)) for i in range(10)]
            assert time.monotonic() - t0 < 2.0
        assert accepted.count(True) == 4
        assert tier.stats()["dropped_queue_full"] == accepted.count(False)
        assert tier.flush()
        assert [tier.get(k(i)) is not None for i in range(10)] == accepted
        assert tier.take_lost() == []  # the caller was told False; nothing to report


def test_reads_from_another_thread_during_writes(tmp):
    errors: list[BaseException] = []
    stop = threading.Event()
    with SSDTier(tmp, capacity_bytes=32 * MiB, fingerprint=FP) as tier:
        def reader() -> None:
            try:
                while not stop.is_set():
                    for i in range(0, 100, 7):
                        got = tier.get(k(i))
                        assert got is None or got == kv_like(32768, i)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        for i in range(100):
            tier.put(k(i), kv_like(32768, i))
        tier.flush()
        stop.set()
        for t in threads:
            t.join()
    assert not errors


def test_fork_child_never_touches_the_environment(tmp):
    with SSDTier(tmp, capacity_bytes=4 * MiB, fingerprint=FP) as tier:
        tier.put(k(0), rand(100))
        tier.flush()
        pid = os.fork()
        if pid == 0:  # child: must see a disabled tier, and must not crash
            ok = tier.get(k(0)) is None and tier.put(k(1), rand(100)) is False
            tier.close()
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert tier.get(k(0)) == rand(100)
        tier.put(k(2), rand(100))
        assert tier.flush()


# ---------------------------------------------------------------------- bad input

def test_bad_arguments_are_named(tmp, tmp_path):
    good = dict(capacity_bytes=4 * MiB, fingerprint=FP)
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="^path"):
        SSDTier(afile, **good)
    with pytest.raises(ConfigError, match="^path"):
        SSDTier(tmp_path / "missing" / "ssd", **good)
    with pytest.raises(ConfigError, match="^capacity_bytes"):
        SSDTier(tmp, capacity_bytes=4 * MiB, fingerprint=FP, block_nbytes=4 * MiB)
    with pytest.raises(ConfigError, match="^fingerprint"):
        SSDTier(tmp, capacity_bytes=4 * MiB, fingerprint="")
    with pytest.raises(ValueError, match="^compression"):
        SSDTier(tmp, compression="lz4", **good)
    assert afile.read_text() == "x" and not tmp.exists()
    with SSDTier(tmp, block_nbytes=1000, **good) as tier:
        with pytest.raises(ValueError, match="^key"):
            tier.put("abc", rand(1000))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="^keys"):
            tier.get_many([1])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="^data"):
            tier.put(k(0), rand(999))
        with pytest.raises(ValueError, match="^data"):
            tier.put(k(0), [1, 2, 3])
        with pytest.raises(ValueError, match="^keys"):
            tier.discard_many([k(0), "abc"])  # type: ignore[list-item]
        with pytest.raises(ConfigError, match="^path"):
            SSDTier(tmp, **good)  # the same environment twice in one process


def test_foreign_directories_are_refused_and_untouched(tmp_path):
    import lmdb
    other = tmp_path / "notes"
    other.mkdir()
    (other / "readme.txt").write_text("mine")
    with pytest.raises(ConfigError, match="^path"):
        SSDTier(other, capacity_bytes=4 * MiB, fingerprint=FP)
    assert [p.name for p in other.iterdir()] == ["readme.txt"]
    for named in (True, False):  # another service's databases, or records in the main one
        foreign = tmp_path / f"foreign-{named}"
        foreign.mkdir(mode=0o750)
        env = lmdb.open(str(foreign), map_size=MiB, max_dbs=2, mode=0o640)
        with env.begin(write=True) as txn:
            txn.put(b"hello", b"world", db=env.open_db(b"sessions", txn=txn) if named else None)
        env.close()
        before = {p.name: (p.read_bytes(), p.stat().st_mode & 0o777) for p in foreign.iterdir()}
        with pytest.raises(ConfigError, match="^path: .*did not create"):
            SSDTier(foreign, capacity_bytes=4 * MiB, fingerprint=FP)
        after = {p.name: (p.read_bytes(), p.stat().st_mode & 0o777) for p in foreign.iterdir()}
        assert after == before and foreign.stat().st_mode & 0o777 == 0o750


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_path(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="^path"):
            SSDTier(ro / "ssd", capacity_bytes=4 * MiB, fingerprint=FP)
    finally:
        ro.chmod(0o700)
    with SSDTier(ro / "ssd", capacity_bytes=4 * MiB, fingerprint=FP) as tier:
        tier.put(k(0), rand(8192))
    (ro / "ssd" / "blocks.dat").chmod(0o400)
    with pytest.raises(ConfigError, match="blocks.dat"):
        SSDTier(ro / "ssd", capacity_bytes=4 * MiB, fingerprint=FP)


def test_trickled_puts_share_commits_and_syncs(tmp):
    """One block at a time (as an engine spills) must not cost an fsync per block."""
    with SSDTier(tmp, capacity_bytes=16 * MiB, fingerprint=FP) as tier:
        for i in range(60):
            assert tier.put(k(i), rand(4096, i))
            time.sleep(0.001)
        before = tier.stats()
        assert tier.flush()
        after = tier.stats()
        assert before["syncs"] <= 3, before["syncs"]
        assert after["syncs"] >= 1 and after["blocks_written"] == 60
        assert after["batches_committed"] < 60
    with SSDTier(tmp, capacity_bytes=16 * MiB, fingerprint=FP) as tier:
        assert all(tier.get(k(i)) == rand(4096, i) for i in range(60))



# ---------------------------------------------------------------------- keys() in LRU order

def test_keys_are_listed_least_recently_used_first_across_restarts(tmp):
    with SSDTier(tmp, capacity_bytes=8 * MiB, fingerprint=FP) as tier:
        fill(tier, range(5), size=8192)
        assert list(tier.keys()) == [k(i) for i in range(5)]
        assert tier.get(k(1)) is not None and tier.get(k(3)) is not None
        assert tier.put(k(0), rand(8192, 0))   # a put of a stored key is an access too
        tier.flush()
        order = [k(2), k(4), k(1), k(3), k(0)]
        assert list(tier.keys()) == order
    with SSDTier(tmp, capacity_bytes=8 * MiB, fingerprint=b"other") as other:
        fill(other, range(10, 12), size=8192)  # interleaved in the shared LRU: not listed
        assert list(other.keys()) == [k(10), k(11)]
    with SSDTier(tmp, capacity_bytes=8 * MiB, fingerprint=FP) as tier:
        assert list(tier.keys()) == order
        fill(tier, range(5, 6), size=8192)
        assert list(tier.keys()) == order + [k(5)]


def test_keys_order_is_the_eviction_order(tmp):
    cap = 2 * MiB
    with SSDTier(tmp, capacity_bytes=cap, fingerprint=FP, compression="none") as tier:
        fill(tier, range(20))
        tier.get_many([k(i) for i in (7, 3, 11)])
        tier.flush()
        order = list(tier.keys())
        fill(tier, range(100, 100 + capacity_blocks(cap, 65536)))  # evicts all 20, in order
        assert tier.take_lost() == order


# ---------------------------------------------------------------------- discard_many

def test_discard_many_deletes_and_frees_the_pages(tmp):
    with SSDTier(tmp, capacity_bytes=8 * MiB, fingerprint=FP, compression="none") as tier:
        fill(tier, range(6))
        used = tier.stats()["current_bytes"]
        tier.discard_many([k(1), k(4), k(99)])         # k(99) was never stored
        assert k(1) not in tier and tier.get(k(4)) is None  # at once, before the commit
        assert list(tier.keys()) == [k(0), k(2), k(3), k(5)]
        assert tier.flush()
        s = tier.stats()
        assert s["discarded"] == 2 and s["evictions"] == 0 and s["corrupt_deleted"] == 0
        assert s["current_bytes"] == used - 2 * record_footprint(48, 65536)
        fill(tier, range(10, 12))                      # into the discarded records' pages
        assert tier.stats()["block_file_bytes"] == 6 * 65536
        assert tier.get_many([k(10), k(11)]) == [rand(65536, 10), rand(65536, 11)]
        assert tier.take_lost() == []
    with SSDTier(tmp, capacity_bytes=8 * MiB, fingerprint=FP, compression="none") as tier:
        assert list(tier.keys()) == [k(0), k(2), k(3), k(5), k(10), k(11)]
        assert tier.get(k(1)) is None and tier.get(k(3)) == rand(65536, 3)


def test_discard_cancels_a_queued_put_and_recycles_its_buffer(tmp):
    with SSDTier(tmp, capacity_bytes=8 * MiB, fingerprint=FP, compression="none") as tier:
        with writer_stalled(tier):
            assert tier.put(k(0), np.frombuffer(rand(65536, 0), np.uint8))
            time.sleep(0.2)                            # the writer took k(0) and waits
            assert tier.put(k(1), np.frombuffer(rand(65536, 1), np.uint8))
            assert tier.stats()["queued_bytes"] == 2 * 65536
            tier.discard_many([k(1)])
            assert tier.stats()["queued_bytes"] == 65536 and k(1) not in tier
            assert tier.get(k(1)) is None
        assert tier.flush()
        s = tier.stats()
        assert s["blocks_written"] == 1 and s["discarded"] == 0
        assert list(tier.keys()) == [k(0)] and tier.take_lost() == []


def test_discard_of_a_block_being_written_deletes_it_after(tmp):
    with SSDTier(tmp, capacity_bytes=8 * MiB, fingerprint=FP, compression="none") as tier:
        with writer_stalled(tier):
            assert tier.put(k(0), rand(65536, 0))
            time.sleep(0.5)                            # in the writer's hands
            tier.discard_many([k(0)])
            assert k(0) not in tier and tier.get(k(0)) is None
        assert tier.flush()
        s = tier.stats()
        assert s["blocks_written"] == 1 and s["discarded"] == 1 and s["current_bytes"] == 0
        assert list(tier.keys()) == [] and tier.take_lost() == []


@pytest.mark.parametrize("stalled", [False, True])
def test_a_put_after_a_discard_stores_the_new_block(tmp, stalled):
    with SSDTier(tmp, capacity_bytes=8 * MiB, fingerprint=FP, compression="none") as tier:
        fill(tier, range(3))
        with writer_stalled(tier) if stalled else contextlib.nullcontext():
            tier.put(k(5), rand(65536, 5))
            time.sleep(0.05)
            tier.discard_many([k(1), k(5)])
            assert tier.put(k(1), rand(65536, 101))    # stored again, not "already present"
            assert tier.put(k(5), rand(65536, 105))
            assert tier.put(k(5), rand(65536, 999))    # a queued put of it: a no-op
            assert tier.get(k(1)) == rand(65536, 101)
        assert tier.flush()
        assert tier.get(k(1)) == rand(65536, 101) and tier.get(k(5)) == rand(65536, 105)
        assert tier.stats()["current_bytes"] == 4 * record_footprint(48, 65536)
        assert list(tier.keys())[-2:] == [k(1), k(5)]
    with SSDTier(tmp, capacity_bytes=8 * MiB, fingerprint=FP, compression="none") as tier:
        assert tier.get(k(1)) == rand(65536, 101) and tier.get(k(5)) == rand(65536, 105)
        assert tier.stats()["corrupt_deleted"] == 0


# ---------------------------------------------------------------------- take_lost

def test_take_lost_reports_capacity_evictions_once(tmp):
    cap = 2 * MiB
    fits = capacity_blocks(cap, 65536)
    with SSDTier(tmp, capacity_bytes=cap, fingerprint=FP, compression="none") as tier:
        fill(tier, range(fits + 5))
        assert tier.take_lost() == [k(i) for i in range(5)]
        assert tier.take_lost() == []
        tier.discard_many([k(5)])
        fill(tier, range(100, 103))
        assert tier.take_lost() == [k(6), k(7)]        # k(5) was discarded, not lost


def test_take_lost_forgets_a_key_put_again(tmp):
    cap = 2 * MiB
    fits = capacity_blocks(cap, 65536)
    with SSDTier(tmp, capacity_bytes=cap, fingerprint=FP, compression="none") as tier:
        fill(tier, range(fits + 3))
        fill(tier, range(1, 2))                        # k(1) lost, then stored again
        assert k(1) in tier
        assert tier.take_lost() == [k(0), k(2), k(3)]  # and storing k(1) evicted k(3)


def test_take_lost_ignores_other_fingerprints(tmp):
    with SSDTier(tmp, capacity_bytes=2 * MiB, fingerprint=b"other", compression="none") as o:
        fill(o, range(100, 110))
    with SSDTier(tmp, capacity_bytes=2 * MiB, fingerprint=FP, compression="none") as tier:
        fill(tier, range(40))                          # evicts the other fingerprint's first
        ours = 50 - capacity_blocks(2 * MiB, 65536) - 10
        assert ours > 0 and tier.take_lost() == [k(i) for i in range(ours)]
        assert tier.stats()["evictions"] == 10 + ours


def test_write_errors_drop_and_report_and_discards_still_commit(tmp):
    """A real write error (RLIMIT_FSIZE makes writes past 1 MiB fail with EFBIG, as a full
    disk would): the batch is dropped, counted and reported lost; a discard asked for
    meanwhile is committed all the same, and its pages take the next block. Each flush
    after a dropped block says so (False, the reason in stats); the first flush with
    nothing dropped is True again."""
    out = helper("efbig", tmp, MiB)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    full = MiB // 65536
    assert res["lost_full"] == list(range(full, full + 4))
    assert res["flush_ok"] == [True] * full + [False] * 4
    assert res["exact"] and res["recovered"]
    assert res["lost_discard"] in ([full + 4], [])      # [] only if the discard came first
    assert res["flushed"] is (not res["lost_discard"])
    assert "File too large" in res["stats"]["last_error"]
    expect = set(range(2, full)) | {full + 5} | ({full + 4} if not res["lost_discard"] else set())
    assert set(res["present"]) == expect
    s = res["stats"]
    assert s["dropped_write_error"] == 4 + len(res["lost_discard"]) and s["available"]
    assert s["discarded"] == 2 and s["block_file_bytes"] <= MiB


# ---------------------------------------------------------------------- capacity_blocks

@pytest.mark.parametrize("block", [65536, 100_000, 65536 + 500])
def test_capacity_blocks_is_exactly_what_the_tier_holds(tmp, block):
    n = capacity_blocks(3 * MiB, block)
    cap = n * record_footprint(16 + 32, block)        # the tightest capacity for n blocks
    assert capacity_blocks(cap, block) == n and capacity_blocks(cap - 1, block) == n - 1
    with SSDTier(tmp, capacity_bytes=cap, fingerprint=FP, compression="none") as tier:
        fill(tier, range(n), size=block)
        s = tier.stats()
        assert s["evictions"] == 0 and s["current_bytes"] == cap and tier.take_lost() == []
        fill(tier, range(n, n + 1), size=block)
        assert tier.stats()["evictions"] == 1 and tier.take_lost() == [k(0)]
        assert len(list(tier.keys())) == n


def test_capacity_blocks_counts_the_key_length():
    assert capacity_blocks(10 * MiB, 65536, key_len=400) < capacity_blocks(10 * MiB, 65536)
    with pytest.raises(ValueError, match="capacity_blocks"):
        capacity_blocks(MiB, 0)


_REOPEN = """
import sys
from kvstrata.tiers.ssd import SSDTier
with SSDTier(sys.argv[1], capacity_bytes=16 * 1024**2, fingerprint="fp") as t:
    for i in range(30):
        t.get(i.to_bytes(32, "little"))
    t.put(b"x" * 32, b"y" * 4096)
"""


@pytest.mark.slow
def test_bit_rot_after_a_clean_close_cannot_crash_the_opener(tmp_path):
    """Bytes flipped while the tier was closed cleanly. LMDB itself may SIGBUS or abort on
    a damaged page (seen with these flips when the pre-open walk was skipped after a clean
    close): the opener must survive every variant, here checked in fresh processes."""
    import random
    import shutil

    base = tmp_path / "base"
    with SSDTier(base, capacity_bytes=16 * MiB, fingerprint="fp") as tier:
        for i in range(30):
            tier.put(i.to_bytes(32, "little"), rand(65536, i))
            tier.flush()
    clean = (base / "data.mdb").read_bytes()
    for seed in range(12):
        path = tmp_path / f"rot{seed}"
        shutil.copytree(base, path)
        raw = bytearray(clean)
        for off in random.Random(seed).sample(range(len(raw)), 4000):
            raw[off] ^= 0xFF
        (path / "data.mdb").write_bytes(bytes(raw))
        out = subprocess.run([sys.executable, "-c", _REOPEN, str(path)], capture_output=True, text=True,
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
        assert out.returncode == 0, (seed, out.returncode, out.stderr[-2000:])


def test_an_access_to_a_block_still_queued_makes_it_most_recent_once_written(tmp):
    """touch_many (and a put of a queued key) of blocks not written yet is applied when
    the batch that writes them commits, not lost before their records exist."""
    with SSDTier(tmp, capacity_bytes=8 * MiB, fingerprint=FP, compression="none") as tier:
        for i in range(6):
            tier.put(k(i), rand(65536, i))
        tier.touch_many([k(1), k(0)])   # queued (a batch lingers before it commits)
        tier.touch_many([k(99)])        # absent: ignored
        assert tier.flush()
        assert list(tier.keys()) == [k(i) for i in (2, 3, 4, 5, 1, 0)]
    with SSDTier(tmp, capacity_bytes=8 * MiB, fingerprint=FP, compression="none") as tier:
        assert list(tier.keys()) == [k(i) for i in (2, 3, 4, 5, 1, 0)]
        tier.touch_many([k(2)])
        assert tier.flush() and list(tier.keys())[-1] == k(2)
