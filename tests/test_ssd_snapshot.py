"""Reopening the SSD tier: the clean-close snapshot, and recovery in the background after
an unclean shutdown. Real LMDB environments, real processes killed with SIGKILL; the
only stand-in is a gate in front of the recovery's walk (the real one runs behind it),
so that a test can look at the tier while the walk has not finished."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstrata.errors import ConfigError
from kvstrata.tiers.ssd import SSDTier, record_footprint
from kvstrata.tiers.ssd import recovery
from kvstrata.tiers.ssd.snapshot import CLEAN, take

from recovery_gate import hold_walks

ROOT = str(Path(__file__).resolve().parents[1])
MiB = 1024**2
FP = "model-a/fp16/bs16"


def k(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


def block(i: int, n: int = 4096) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def open_tier(path: Path, capacity: int = 64 * MiB, **kw: Any) -> SSDTier:
    return SSDTier(path, capacity_bytes=capacity, fingerprint=FP, compression="none", **kw)


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path / "ssd"


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The environments recovery walks in this test (the real walk still runs)."""
    seen: list[Path] = []
    real = recovery.walk

    def spy(path: Path, *args: Any, **kw: Any) -> Any:
        seen.append(path)
        return real(path, *args, **kw)
    monkeypatch.setattr(recovery, "walk", spy)
    return seen


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Recovery's walk waits until the test sets this event (or the walk is cancelled)."""
    return hold_walks(monkeypatch)


def fill(tier: SSDTier, ids: range, n: int = 4096) -> None:
    for i in ids:
        assert tier.put(k(i), block(i, n))
    assert tier.flush()


# ====================================================================== a clean close

def test_a_clean_close_reopens_from_the_snapshot_without_walking(tmp, walks):
    with open_tier(tmp) as tier:
        fill(tier, range(300))
        tier.discard_many([k(i) for i in range(0, 300, 3)])  # holes in the page file
        tier.get_many([k(1), k(2)])                            # recency to keep
        assert tier.flush()
        free_before = [a.tolist() for a in tier._files.space.free_extents()]
        used_before = tier.stats()["current_bytes"]
        order = list(tier.keys())
    assert walks == [] and (tmp / CLEAN).exists()
    with open_tier(tmp) as tier:
        assert walks == [] and not (tmp / CLEAN).exists()  # read and removed at open
        assert [a.tolist() for a in tier._files.space.free_extents()] == free_before
        assert tier.stats()["current_bytes"] == used_before and list(tier.keys()) == order
        kept = [i for i in range(300) if i % 3]
        assert tier.get_many([k(i) for i in kept]) == [block(i) for i in kept]
        fill(tier, range(300, 400))                            # into the holes first
        assert tier.get_many([k(i) for i in range(300, 400)]) == [block(i) for i in range(300, 400)]
        assert tier.stats()["corrupt_deleted"] == 0
    with open_tier(tmp) as tier:
        assert walks == [] and tier.get(k(350)) == block(350)


def test_the_snapshot_counts_other_fingerprints(tmp, walks, caplog):
    with SSDTier(tmp, capacity_bytes=64 * MiB, fingerprint="other", compression="none") as tier:
        fill(tier, range(7))
    with caplog.at_level(logging.INFO, logger="kvstrata.tiers.ssd"):
        with open_tier(tmp) as tier:
            fill(tier, range(10, 13))
            tier.discard_many([k(10)])
            assert tier.flush()
        with SSDTier(tmp, capacity_bytes=64 * MiB, fingerprint="other", compression="none"):
            pass
    said = [r.getMessage() for r in caplog.records if "other fingerprints" in r.getMessage()]
    assert walks == [] and len(said) == 2
    assert "7 of its 7 records" in said[0] and "2 of its 9 records" in said[1]


def test_a_changed_index_means_a_full_recovery(tmp, walks, caplog):
    """data.mdb written after the clean close (a copy from elsewhere, another tool): the
    snapshot no longer vouches for it."""
    import lmdb
    with open_tier(tmp) as tier:
        fill(tier, range(50))
    env = lmdb.open(str(tmp), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"x", b"y", db=env.open_db(b"meta", txn=txn))
    env.close()
    with caplog.at_level(logging.WARNING, logger="kvstrata.tiers.ssd"):
        with open_tier(tmp) as tier:
            assert walks == [tmp]
            assert tier.get_many([k(i) for i in range(50)]) == [block(i) for i in range(50)]
    assert any("the clean close; verifying it in full" in r.getMessage() for r in caplog.records)


def test_a_damaged_snapshot_means_a_full_recovery(tmp, walks):
    with open_tier(tmp) as tier:
        fill(tier, range(50))
    with open(tmp / CLEAN, "r+b") as f:
        f.seek(40)
        byte = f.read(1)[0]
        f.seek(40)
        f.write(bytes([byte ^ 0x10]))
    with open_tier(tmp) as tier:
        assert walks == [tmp]
        assert tier.get_many([k(i) for i in range(50)]) == [block(i) for i in range(50)]


def test_a_crash_after_a_clean_open_is_an_unclean_shutdown(tmp, walks):
    with open_tier(tmp) as tier:
        fill(tier, range(20))
    kill_holding(tmp, 30)  # opens from the snapshot, flushes 30 blocks, is killed
    assert not (tmp / CLEAN).exists()
    with open_tier(tmp) as tier:
        assert walks == [tmp]
        assert tier.get_many([k(i) for i in range(30)]) == [block(i) for i in range(30)]


def test_a_truncated_page_file_rebuilds_the_map_from_heads_the_snapshot_vouched_for(tmp, walks):
    with open_tier(tmp) as tier:
        fill(tier, range(20), n=65536)
    with open(tmp / "blocks.dat", "r+b") as f:
        f.truncate(12 * 65536)
    with open_tier(tmp) as tier:
        assert walks == []  # data.mdb is as closed: no walk, only the map is rebuilt
        got = tier.get_many([k(i) for i in range(20)])
        assert got == [block(i, 65536) for i in range(12)] + [None] * 8
        assert sorted(tier.take_lost()) == sorted(k(i) for i in range(12, 20))


@pytest.mark.parametrize("capacity", [2 * MiB, 256 * MiB])
def test_a_new_capacity_reopens_from_the_snapshot(tmp, walks, capacity):
    with open_tier(tmp, 64 * MiB) as tier:
        fill(tier, range(240), n=65536)                      # 15 MiB
    with open_tier(tmp, capacity) as tier:
        assert walks == []
        space = tier._files.space
        assert space.limit == (capacity + tier.slack_bytes) // 4096
        assert tier.get_many([k(i) for i in range(240)]) == [block(i, 65536) for i in range(240)]
        fill(tier, range(240, 250), n=65536)
        assert tier.stats()["current_bytes"] <= capacity
        assert tier.get_many([k(i) for i in range(240, 250)]) == [block(i, 65536) for i in range(240, 250)]
    with open_tier(tmp, 512 * MiB) as tier:  # larger again (after 2 MiB: records lay past it)
        assert tier.get(k(249)) == block(249, 65536)
        got = tier.get_many([k(i) for i in range(240)])
        kept = [i for i, g in enumerate(got) if g is not None]
        assert all(got[i] == block(i, 65536) for i in kept)
        assert kept == list(range(240 - len(kept), 240)) and (capacity < 64 * MiB) == (len(kept) < 240)
    assert walks == []


def test_no_snapshot_from_a_disabled_tier(tmp):
    with open_tier(tmp) as tier:
        fill(tier, range(3))
    (tmp / "data.mdb").write_bytes(os.urandom(64 * 1024))
    tier = open_tier(tmp)
    assert not tier.stats()["available"]
    tier.close()
    assert not (tmp / CLEAN).exists()


_FORGE = """
import sys, lmdb
env = lmdb.open(sys.argv[1], max_dbs=8, map_size=int(sys.argv[3]))
with env.begin(write=True) as txn:
    txn.put(bytes.fromhex(sys.argv[2]), b"not a head" * 5, db=env.open_db(b"head", txn=txn))
env.close()
"""


def test_a_record_whose_pages_are_unknown_leaves_no_snapshot(tmp, walks):
    """A head that does not verify is deleted without freeing pages (which, is unknown):
    the map no longer describes the page file, so the next open rebuilds it."""
    with open_tier(tmp) as tier:
        fill(tier, range(5))
        out = subprocess.run([sys.executable, "-c", _FORGE, str(tmp), (tier._ns + k(99)).hex(),
                              str(tier.capacity_bytes + tier.slack_bytes)], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert tier.get(k(99)) is None and tier.flush()
        assert tier.stats()["corrupt_deleted"] == 1
    assert not (tmp / CLEAN).exists()
    with open_tier(tmp) as tier:
        assert walks == [tmp]
        assert tier.get_many([k(i) for i in range(5)]) == [block(i) for i in range(5)]


def test_take_reads_and_removes_the_snapshot(tmp):
    with open_tier(tmp) as tier:
        fill(tier, range(3))
    snap, why = take(tmp)
    assert snap is not None and why == "" and snap.check(tmp) is None
    assert take(tmp) == (None, "not closed cleanly")
    (tmp / CLEAN).write_bytes(b"")  # the empty marker of an older version
    assert take(tmp) == (None, f"{CLEAN} does not verify")


# ====================================================================== an unclean shutdown

_HOLD = """
import sys
from kvstrata.tiers.ssd import SSDTier
import numpy as np, hashlib
def k(i): return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()
def block(i): return np.random.default_rng(i).integers(0, 256, 4096, dtype=np.uint8).tobytes()
tier = SSDTier(sys.argv[1], capacity_bytes=64 << 20, fingerprint="model-a/fp16/bs16",
               compression="none")
for i in range(int(sys.argv[2])):
    assert tier.put(k(i), block(i))
assert tier.flush()
print("flushed", flush=True)
for i in range(int(sys.argv[2]), 10**6):   # more puts, not flushed, when the kill comes
    tier.put(k(i), block(i))
"""


def kill_holding(path: Path, n: int) -> None:
    """A process that flushed ``n`` blocks into the tier at ``path`` and goes on putting
    more, killed with SIGKILL."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(path), str(n)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "flushed"
        time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)


def test_after_a_sigkill_the_tier_opens_at_once_and_serves_once_recovered(tmp, gate):
    """open() returns while the walk has not even started; until the recovery is over the
    tier serves nothing (it has verified nothing), queues puts and discards, and then
    serves every flushed block exactly, and what was queued meanwhile."""
    kill_holding(tmp, 500)
    t0 = time.monotonic()
    tier = open_tier(tmp, recover_inline_bytes=0)
    try:
        assert time.monotonic() - t0 < 5 and not gate.is_set()
        s = tier.stats()
        assert s["recovering"] and s["available"] and s["current_bytes"] == 0
        assert tier.get(k(1)) is None and k(1) not in tier and list(tier.keys()) == []
        assert tier.get_into([k(2)], [bytearray(4096)]) == [False]
        assert tier.put(k(10**7), block(7)) and tier.put(k(2), block(2))
        tier.discard_many([k(3)])
        assert tier.flush(timeout=0.2) is False          # not written before the recovery
        assert not tier.wait_ready(timeout=0.1)
        gate.set()
        assert tier.wait_ready(timeout=60)
        assert not tier.stats()["recovering"]
        assert tier.flush()
        kept = [i for i in range(500) if i != 3]
        assert tier.get_many([k(i) for i in kept]) == [block(i) for i in kept]
        assert tier.get(k(3)) is None and tier.get(k(10**7)) == block(7)
        s = tier.stats()
        assert s["corrupt_deleted"] == 0 and s["discarded"] == 1
        assert s["current_bytes"] >= 499 * record_footprint(48, 4096)
        assert tier.take_lost() == []
    finally:
        tier.close()
    assert (tmp / CLEAN).exists()
    with open_tier(tmp) as again:                          # and the next open is a quick one
        assert again.get(k(10**7)) == block(7) and again.get(k(3)) is None


def test_a_load_that_misses_during_the_recovery_does_not_report_the_record_lost(tmp, gate):
    """A load planned before the background recovery is over misses (the block is
    recomputed), but the key is not reported lost, so the policy keeps it and the next
    load, once the record is verified, succeeds. A record the recovery drops is reported
    by the tier itself; a miss after the recovery is a loss."""
    from kvstrata.dataplane.executor import Executor
    from kvstrata.policy import LoadPlan

    kill_holding(tmp, 10)
    tier = open_tier(tmp, recover_inline_bytes=0)
    try:
        ex = Executor(None, {"ssd": tier})
        rows = np.zeros((2, 4096), dtype=np.uint8)

        def load(*ids: int) -> tuple[list[bool], list[tuple[str, bytes]]]:
            plan = LoadPlan(1, "r", [0, 1], [k(i) for i in ids], [-1, -1], ["ssd", "ssd"], [-1, -1], slab="cpu")
            ok = [False, False]
            return ok, ex.read_keyed(plan, rows, ok)

        assert tier.recovering()
        assert load(1, 2) == ([False, False], [])
        assert ex.counts["load_failures_ssd"] == 2
        gate.set()
        assert tier.wait_ready(60)
        read_before = ex.counts["bytes_ssd_read"]
        assert load(1, 2) == ([True, True], []) and rows[1].tobytes() == block(2)
        # storage to host memory is timed (what vLLM's own load metric misses): bytes of the blocks read
        assert ex.counts["bytes_ssd_read"] - read_before == 2 * 4096 and ex.counts["seconds_ssd_read"] > 0
        assert load(3, 10**6) == ([True, False], [("ssd", k(10**6))])
    finally:
        tier.close()


def test_a_damaged_environment_found_in_the_background_disables_the_tier(tmp, gate, caplog):
    kill_holding(tmp, 100)
    data = tmp / "data.mdb"
    size = data.stat().st_size
    with open(data, "r+b") as f:  # a torn index: the file ends before its last pages
        f.truncate(size // 2)
    with caplog.at_level(logging.ERROR, logger="kvstrata.tiers.ssd"):
        tier = open_tier(tmp, recover_inline_bytes=0)
        assert tier.put(k(7), block(7))
        gate.set()
        assert tier.wait_ready(timeout=60) is False
        s = tier.stats()
        assert not s["available"] and not s["recovering"] and "verify" in s["disabled_reason"]
        assert tier.get(k(1)) is None and tier.flush() is False
        assert tier.take_lost() == [k(7)]                  # accepted, then dropped
        tier.close()
    assert sum(str(tmp) in r.getMessage() for r in caplog.records) == 1
    assert not (tmp / CLEAN).exists()


def test_close_during_a_background_recovery_cancels_it(tmp, gate, walks):
    kill_holding(tmp, 100)
    tier = open_tier(tmp, recover_inline_bytes=0)
    assert tier.put(k(10**7), block(7))
    closer = threading.Thread(target=tier.close)
    t0 = time.monotonic()
    closer.start()
    closer.join(30)
    assert not closer.is_alive() and time.monotonic() - t0 < 30
    assert not (tmp / CLEAN).exists()                      # nothing was verified
    gate.set()
    with open_tier(tmp) as again:                          # recovers, inline this time
        assert again.get_many([k(i) for i in range(100)]) == [block(i) for i in range(100)]
        assert again.stats()["corrupt_deleted"] == 0


def test_an_environment_kvstrata_did_not_create_stops_start_up_whatever_its_size(tmp_path, gate):
    """Identified before anything is touched, also where the index would recover in the
    background (the walk is held back: it is never reached)."""
    import lmdb
    foreign = tmp_path / "foreign"
    env = lmdb.open(str(foreign), map_size=MiB)
    with env.begin(write=True) as txn:
        txn.put(b"hello", b"world")
    env.close()
    before = {p.name: p.read_bytes() for p in foreign.iterdir()}
    with pytest.raises(ConfigError, match="^path: .*did not create"):
        open_tier(foreign, recover_inline_bytes=0)
    assert {p.name: p.read_bytes() for p in foreign.iterdir()} == before


def test_a_small_index_recovers_before_the_constructor_returns(tmp, walks):
    kill_holding(tmp, 50)
    with open_tier(tmp) as tier:                           # below recover_inline_bytes
        assert walks == [tmp] and not tier.stats()["recovering"]
        assert tier.get_many([k(i) for i in range(50)]) == [block(i) for i in range(50)]
