"""The SSD tier under deployment mistakes and hostile conditions: a second owner of one
directory (another process, this process, a forked child), a full disk (a real tmpfs
mounted full), loose permissions, over-long keys, a close racing reads, a smaller
capacity at reopen, and reading the keys of a tier another process owns. Real LMDB
environments, real processes, real file systems; nothing mocked."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from kvstrata.errors import ConfigError
from kvstrata.tiers.ssd import SSDTier
from kvstrata.tiers.ssd.tier import MAX_KEY_LEN, read_keys

from recovery_gate import hold_walks

ROOT = str(Path(__file__).resolve().parents[1])
MiB = 1024**2
FP = "model-a/fp16/bs16"


def k(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


def block(i: int, n: int = 65536) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def open_tier(path: Path, capacity: int = 32 * MiB, **kw: object) -> SSDTier:
    return SSDTier(path, capacity_bytes=capacity, fingerprint=FP, compression="none", **kw)


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path / "ssd"


# ====================================================================== one owner

_HOLD = """
import sys
from kvstrata.tiers.ssd import SSDTier
tier = SSDTier(sys.argv[1], capacity_bytes=32 << 20, fingerprint="model-a/fp16/bs16",
               compression="none")
print("open", flush=True)
sys.stdin.read()
tier.close()
"""


@contextlib.contextmanager
def holder(path: Path) -> Iterator[subprocess.Popen]:
    """Another process with the tier at ``path`` open, until the block exits."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT})
    try:
        assert proc.stdout.readline().strip() == "open"
        yield proc
    finally:
        if proc.poll() is None:
            proc.stdin.close()
            proc.wait(30)


def test_a_second_process_is_refused_with_the_holders_pid(tmp):
    with holder(tmp) as proc:
        with pytest.raises(ConfigError, match=rf"in use by process {proc.pid}\b"):
            open_tier(tmp)
    with open_tier(tmp) as tier:  # the holder closed: free again
        assert tier.put(k(0), block(0)) and tier.flush()


def test_the_lock_goes_with_a_killed_holder(tmp):
    with holder(tmp) as proc:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        with open_tier(tmp) as tier:
            assert tier.stats()["available"]


def test_a_second_instance_in_this_process_is_refused(tmp):
    with open_tier(tmp):
        with pytest.raises(ConfigError, match="in use by this process"):
            open_tier(tmp)
        with pytest.raises(ConfigError, match="in use by this process"):
            open_tier(Path(str(tmp) + "/."))  # another spelling of the same directory


_SECOND = """
import sys
from kvstrata.errors import ConfigError
from kvstrata.tiers.ssd import SSDTier
try:
    tier = SSDTier(sys.argv[1], capacity_bytes=32 << 20, fingerprint="model-b",
                   compression="none")
except ConfigError as exc:
    print(exc)
    sys.exit(7)
for i in range(200):
    tier.put(b"%032d" % i, bytes([i % 251]) * 65536)
tier.close()
"""


def test_a_second_writer_never_costs_confirmed_blocks(tmp):
    """A second process on the directory (a replica started from the same config) used
    to share it, each with its own free-space map, overwriting confirmed pages."""
    with open_tier(tmp) as first:
        for i in range(40):
            assert first.put(k(i), block(i))
        assert first.flush()
        proc = subprocess.run([sys.executable, "-c", _SECOND, str(tmp)], capture_output=True,
                              text=True, timeout=120, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": ROOT})
        assert proc.returncode == 7 and f"in use by process {os.getpid()}" in proc.stdout
        assert first.get_many([k(i) for i in range(40)]) == [block(i) for i in range(40)]


def _in_child(fn) -> int:
    """Run ``fn`` in a forked child; its exit status (0: fn returned True)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if fn() else 1
        except BaseException as exc:  # report, never return into pytest in the child
            print(f"child: {exc!r}", file=sys.stderr, flush=True)
            code = 2
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_forked_child_opens_tiers_of_its_own(tmp, tmp_path):
    """The child inherits the parent's tier and its lock descriptor: it opens tiers of
    its own, and is refused the parent's directory with a clear error: naming the parent
    while the parent has it, saying why once the parent let it go (LMDB: one handle per
    environment and process, and the child's copy of the parent's must stay untouched)."""
    parent = open_tier(tmp)
    assert parent.put(k(1), block(1)) and parent.flush()
    ppid = os.getpid()

    def refused() -> bool:
        try:
            open_tier(tmp)
        except ConfigError as exc:
            return f"process {ppid}" in str(exc)
        return False

    def elsewhere() -> bool:
        with open_tier(tmp_path / "child") as mine:
            return mine.put(k(2), block(2)) and mine.flush() and mine.get(k(2)) == block(2)

    assert _in_child(refused) == 0
    assert _in_child(elsewhere) == 0
    go_r, go_w = os.pipe()

    def after_parent_closed() -> bool:
        os.read(go_r, 1)
        try:
            open_tier(tmp)
        except ConfigError as exc:
            return "forked" in str(exc) and "spawn" in str(exc)
        return False

    pid = os.fork()
    if pid == 0:
        os._exit(0 if after_parent_closed() else 1)
    parent.close()
    os.write(go_w, b"x")
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    with open_tier(tmp) as again:  # and the parent itself reopens it
        assert again.get(k(1)) == block(1)


# ====================================================================== a full disk

@contextlib.contextmanager
def small_fs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (needs root, as CI runs)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root (CI runs as root)")
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                   check=True, capture_output=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


def fill(path: Path) -> None:
    """Write zeros to ``path`` until the file system has no room left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (MiB, 4096, 512, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, bytes(size))
    finally:
        os.close(fd)


_OPEN_FULL = """
import json, logging, sys
logging.basicConfig(level=logging.ERROR)
from kvstrata.tiers.ssd import SSDTier
tier = SSDTier(sys.argv[1], capacity_bytes=32 << 20, fingerprint="m", compression="none")
s = tier.stats()
print(json.dumps({"available": s["available"], "reason": s["disabled_reason"],
                  "put": tier.put(b"k" * 32, b"x" * 4096), "get": tier.get(b"k" * 32)}))
tier.close()
"""


def test_opening_on_a_full_disk_is_a_disabled_tier_not_a_signal(tmp_path):
    with small_fs(tmp_path / "fs", "1m") as fs:
        fill(fs / "filler")
        proc = subprocess.run([sys.executable, "-c", _OPEN_FULL, str(fs / "tier")],
                              capture_output=True, text=True, timeout=60, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": ROOT})
        assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
        import json
        out = json.loads(proc.stdout)
        assert out == {"available": False, "reason": out["reason"], "put": False, "get": None}
        assert "disk" in out["reason"] or "space" in out["reason"], out["reason"]
        assert "disabled" in proc.stderr  # logged once, as an error


def test_a_full_disk_fails_the_flush_then_recovers(tmp_path, caplog):
    """Blocks accepted while the disk is full are dropped: the flush says so (False, the
    reason in stats, logged once) and they are reported lost. Once there is room again,
    the tier stores, flushes True and serves exact bytes, with no restart."""
    with small_fs(tmp_path / "fs", "4m") as fs:
        tier = open_tier(fs / "tier")
        try:
            assert tier.put(k(0), block(0)) and tier.flush()
            fill(fs / "filler")
            with caplog.at_level(logging.WARNING, logger="kvstrata.tiers.ssd"):
                accepted = [i for i in range(1, 9) if tier.put(k(i), block(i))]
                assert accepted and not tier.flush()
                assert [k(i) for i in accepted if k(i) not in tier] == \
                       [k(i) for i in accepted] == tier.take_lost()
                assert not any(tier.put(k(i), block(i)) and tier.flush() for i in (9, 10))
            stats = tier.stats()
            assert "No space left" in stats["last_error"] and stats["dropped_write_error"] >= 3
            assert stats["available"]
            assert sum("No space left" in r.getMessage() for r in caplog.records) == 1
            (fs / "filler").unlink()
            assert tier.put(k(11), block(11)) and tier.flush()
            assert tier.get_many([k(0), k(11)]) == [block(0), block(11)]
        finally:
            tier.close()
        with open_tier(fs / "tier") as again:
            assert again.get_many([k(0), k(11)]) == [block(0), block(11)]


# ====================================================================== permissions

def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_kv_at_rest_is_owner_only_whatever_the_umask(tmp):
    old = os.umask(0o002)
    try:
        with open_tier(tmp) as tier:
            assert tier.put(k(0), block(0)) and tier.flush()
        files = sorted(p.name for p in tmp.iterdir())
        assert {"data.mdb", "lock.mdb", "blocks.dat", "kvstrata.lock", "kvstrata.clean"} <= set(files)
        assert _mode(tmp) == 0o700
        assert {name: _mode(tmp / name) for name in files} == dict.fromkeys(files, 0o600)
    finally:
        os.umask(old)


def test_an_existing_loose_directory_is_tightened(tmp, caplog):
    with open_tier(tmp) as tier:
        assert tier.put(k(0), block(0)) and tier.flush()
    os.chmod(tmp, 0o755)
    os.chmod(tmp / "blocks.dat", 0o644)
    with caplog.at_level(logging.WARNING, logger="kvstrata.tiers.ssd"):
        with open_tier(tmp) as tier:
            assert tier.get(k(0)) == block(0)
    assert _mode(tmp) == 0o700 and _mode(tmp / "blocks.dat") == 0o600
    assert sum("readable by others" in r.getMessage() for r in caplog.records) == 2


# ====================================================================== keys

def test_an_over_long_key_is_refused_at_the_door(tmp):
    """LMDB takes keys of at most 511 bytes (prefix included): a longer one used to reach
    the writer and switch the whole tier off."""
    with open_tier(tmp) as tier:
        assert tier.put(b"x" * MAX_KEY_LEN, block(0))
        with pytest.raises(ValueError, match=f"at most {MAX_KEY_LEN} bytes, got 600"):
            tier.put(b"y" * 600, block(1))
        with pytest.raises(ValueError, match="at most"):
            tier.get(b"y" * 600)
        assert b"y" * 600 not in tier
        assert tier.put(k(2), block(2)) and tier.flush()
        assert tier.get_many([b"x" * MAX_KEY_LEN, k(2)]) == [block(0), block(2)]
        assert tier.stats()["available"]


# ====================================================================== close and reads

def test_close_racing_reads_never_raises_nor_logs(tmp, caplog):
    """Readers on other threads while the owner closes: each read is exact or a miss;
    none fails inside LMDB or reads a closed file."""
    for round_ in range(12):
        path = tmp / str(round_)
        tmp.mkdir(exist_ok=True)
        tier = SSDTier(path, capacity_bytes=32 * MiB, fingerprint=FP, compression="zstd")
        keys = [k(i) for i in range(32)]
        for i, key in enumerate(keys):
            assert tier.put(key, block(i, 16384))
        assert tier.flush()
        errors: list[BaseException] = []
        wrong = []

        def read() -> None:
            try:
                for _ in range(300):
                    for i, got in enumerate(tier.get_many(keys)):
                        if got is not None and got != block(i, 16384):
                            wrong.append(i)
                    list(tier.keys())
            except BaseException as exc:
                errors.append(exc)

        with caplog.at_level(logging.WARNING, logger="kvstrata.tiers.ssd"):
            threads = [threading.Thread(target=read) for _ in range(2)]
            for t in threads:
                t.start()
            time.sleep(0.002 * round_)
            tier.close()
            for t in threads:
                t.join()
        assert not errors and not wrong
        assert not [r for r in caplog.records if "failed" in r.getMessage()]


# ====================================================================== capacity

def test_reopening_smaller_keeps_every_record_readable(tmp):
    """Records placed under a larger capacity lie past the smaller one's page limit: the
    page file keeps them (the LRU then evicts down to the new capacity)."""
    n = 240  # 15 MiB: past the page limit of a 2 MiB tier (capacity plus its slack)
    with open_tier(tmp, 32 * MiB) as tier:
        for i in range(n):
            assert tier.put(k(i), block(i))
        assert tier.flush()
    size = (tmp / "blocks.dat").stat().st_size
    with open_tier(tmp, 2 * MiB) as tier:
        assert size > (tier.capacity_bytes + tier.slack_bytes)
        assert (tmp / "blocks.dat").stat().st_size == size
        assert tier.get_many([k(i) for i in range(n)]) == [block(i) for i in range(n)]
        assert tier.put(k(999), block(999)) and tier.flush()
        assert tier.stats()["current_bytes"] <= 2 * MiB and tier.get(k(999)) == block(999)


# ====================================================================== keys of an owned tier

def test_read_keys_beside_the_owner_writes_nothing(tmp):
    """The vLLM scheduler's view of a tier a worker process owns: LRU order, this
    fingerprint only, and nothing in the directory changes."""
    with open_tier(tmp) as tier:
        for i in range(6):
            assert tier.put(k(i), block(i))
        assert tier.flush()
        tier.get(k(0))  # now the most recent
        assert tier.flush()
        before = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in tmp.iterdir()
                  if p.name != "lock.mdb"}  # LMDB's reader table (shared memory) is the one write
        assert read_keys(tmp, FP) == [k(i) for i in (1, 2, 3, 4, 5, 0)]
        assert read_keys(tmp, "another-model") == []
        after = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in tmp.iterdir()
                 if p.name != "lock.mdb"}
        assert after == before
        assert tier.put(k(7), block(7)) and tier.flush()  # the owner is not disturbed
    assert read_keys(tmp.parent / "nothing-here", FP) == []


# ====================================================================== found by review

def test_a_directory_or_file_of_another_user_is_refused(tmp):
    """Another user who could plant the directory (a shared scratch disk) would read the KV
    and forge records that verify (the checksum is not a MAC)."""
    if os.geteuid() != 0:
        pytest.skip("changing a file's owner needs root (CI runs as root)")
    with open_tier(tmp) as tier:
        assert tier.put(k(0), block(0)) and tier.flush()
    os.chown(tmp / "blocks.dat", 1001, 1001)
    with pytest.raises(ConfigError, match=r"blocks\.dat belongs to uid 1001"):
        open_tier(tmp)
    os.chown(tmp / "blocks.dat", 0, 0)
    os.chown(tmp, 1001, 1001)
    with pytest.raises(ConfigError, match=r"belongs to uid 1001, not to this user"):
        open_tier(tmp)


def test_a_symlink_among_the_files_is_refused_and_its_target_untouched(tmp, tmp_path):
    """blocks.dat -> a file of someone's choosing: opening used to chmod it to 0600 and
    truncate it to nothing."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"x" * 640)
    victim.chmod(0o644)
    with open_tier(tmp) as tier:
        assert tier.put(k(0), block(0)) and tier.flush()
    (tmp / "blocks.dat").unlink()
    (tmp / "blocks.dat").symlink_to(victim)
    with pytest.raises(ConfigError, match="not a regular file"):
        open_tier(tmp)
    assert victim.read_bytes() == b"x" * 640 and _mode(victim) == 0o644


@pytest.mark.parametrize("name", ["blocks.dat", "kvstrata.lock", "lock.mdb", "data.mdb"])
@pytest.mark.parametrize("existing", [True, False])
def test_a_hard_link_among_the_files_is_refused_and_its_target_untouched(tmp, tmp_path, name, existing):
    """blocks.dat (or the lock files) hard-linked to a file elsewhere: a regular file with
    its victim's owner, so the owner and symlink checks passed it, and opening a new tier
    chmodded it to 0600 and truncated it (the lock file got the PID written over it)."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"x" * 640)
    victim.chmod(0o644)
    if existing:
        with open_tier(tmp) as tier:
            assert tier.put(k(0), block(0)) and tier.flush()
        (tmp / name).unlink()
    elif name == "data.mdb":
        return  # a directory with a data.mdb is an existing tier: the other case
    else:
        tmp.mkdir(mode=0o700)
    os.link(victim, tmp / name)
    with pytest.raises(ConfigError, match=rf"{re.escape(name)} has 2 names"):
        open_tier(tmp)
    assert victim.read_bytes() == b"x" * 640 and _mode(victim) == 0o644


def test_a_link_planted_after_the_checks_is_refused_on_the_open_descriptor(tmp_path):
    """The path checks run before the files are opened; a link planted in between is
    caught on the descriptor (fstat) before anything is written or truncated."""
    from kvstrata.tiers.ssd.private import open_private

    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"y" * 100)
    os.link(victim, tmp_path / "linked")
    with pytest.raises(ConfigError, match="2 names"):
        open_private(tmp_path / "linked", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    assert victim.read_bytes() == b"y" * 100
    os.symlink(victim, tmp_path / "sym")
    with pytest.raises(ConfigError, match="cannot open"):
        open_private(tmp_path / "sym", os.O_RDWR | os.O_TRUNC)
    assert victim.read_bytes() == b"y" * 100
    fd = open_private(tmp_path / "own", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    os.close(fd)
    assert _mode(tmp_path / "own") == 0o600


def test_a_full_disk_with_pending_deletions_never_hangs_flush_or_close(tmp_path):
    """Deletions that a full disk keeps failing used to hold every flush (and close, and
    the engine's shutdown) until space returned, the writer spinning meanwhile."""
    with small_fs(tmp_path / "fs", "4m") as fs:
        tier = open_tier(fs / "tier")
        for i in range(20):
            assert tier.put(k(i), block(i, 16384))
        assert tier.flush()
        fill(fs / "filler")
        cpu0 = time.process_time()
        tier.discard_many([k(0), k(1)])
        for i in range(20, 40):
            tier.put(k(i), block(i, 16384))
        started = time.monotonic()
        assert tier.flush() is False
        time.sleep(1.0)
        assert time.monotonic() - started < 10 and time.process_time() - cpu0 < 1.0
        closed = threading.Thread(target=tier.close)
        closed.start()
        closed.join(20)
        assert not closed.is_alive()


def test_a_new_tier_on_a_nearly_full_disk_is_disabled_and_recovers(tmp_path):
    """Room for the lock files but not for LMDB's first pages: a ConfigError used to stop
    start-up, and the empty data.mdb left behind disabled the tier at every later open."""
    with small_fs(tmp_path / "fs", "1m") as fs:
        gap = fs / "gap"
        gap.write_bytes(bytes(16384))
        fill(fs / "filler")
        gap.unlink()  # 16 KiB free: the two lock files take it
        tier = open_tier(fs / "tier")
        assert tier.stats()["available"] is False and "LMDB environment" in tier.stats()["disabled_reason"]
        tier.close()
        assert not (fs / "tier" / "data.mdb").exists()
        (fs / "filler").unlink()
        with open_tier(fs / "tier") as again:
            assert again.stats()["available"] and again.put(k(0), block(0)) and again.flush()


def test_a_forked_child_never_blocks_on_locks_its_parent_held(tmp):
    """A thread of the parent (the writer) held the tier's counter lock at the fork: the
    child's calls used to wait for it forever; they miss at once."""
    tier = open_tier(tmp)
    try:
        assert tier.put(k(0), block(0)) and tier.flush()
        with tier._health.lock:  # as the writer thread would, at the moment of the fork
            pid = os.fork()
            if pid == 0:
                try:
                    ok = tier.get(k(0)) is None and not tier.put(k(1), block(1)) and \
                        tier.stats()["gets"] >= 0
                finally:
                    os._exit(0 if ok else 1)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the child blocked on its parent's lock")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        tier.close()


_READER = """
import sys, time, lmdb
env = lmdb.open(sys.argv[1], readonly=True, max_dbs=8, create=False)
txn = env.begin()
print("reading", flush=True)
time.sleep(60)
"""


def test_a_killed_reader_does_not_pin_the_index(tmp):
    """A read_keys child killed inside its transaction left its reader slot behind: the
    pages of its snapshot were never reused and data.mdb grew until the tier disabled
    itself. Stale slots of dead processes are cleared at the next sync."""
    with open_tier(tmp) as tier:
        assert tier.put(k(0), block(0)) and tier.flush()
        proc = subprocess.Popen([sys.executable, "-c", _READER, str(tmp)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "reading"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        env = tier._files.index._env

        def reader_pids() -> set[int]:  # LMDB's reader table: "pid thread txnid" per slot
            return {int(line.split()[0]) for line in env.readers().splitlines()[1:] if line.strip()}

        assert proc.pid in reader_pids()
        assert tier.put(k(1), block(1)) and tier.flush()
        assert proc.pid not in reader_pids()


def test_two_heads_on_one_extent_keep_one(tmp):
    """Two owners with equal free-space maps leave two heads on the same pages; recovery
    used to keep both, and deleting the one that does not verify freed pages the other
    still used."""
    from kvstrata.tiers.ssd.record import Codec, Encoded, NS_LEN
    from kvstrata.tiers.ssd.survey import survey

    codec = Codec("none", 1)
    heads = []
    for i, key in enumerate((b"a" * (NS_LEN + 32), b"b" * (NS_LEN + 32))):
        e = Encoded(key, block(i, 16384), codec)
        e.header = e.header.at_page(10)
        heads.append((key, e.head(0)))
    found = survey([key for key, _ in heads], [head for _, head in heads], 1 << 30)
    assert found.records == 1 and found.bad == [b"b" * (NS_LEN + 32)]


# ====================================================================== round 3

def _unclean(path: Path, n: int = 20) -> None:
    """A tier with ``n`` blocks whose clean-close snapshot is gone (as after a SIGKILL)."""
    with open_tier(path) as tier:
        for i in range(n):
            assert tier.put(k(i), block(i, 8192))
    (path / "kvstrata.clean").unlink()


def test_close_during_a_background_recovery_reports_the_queued_puts_lost(tmp, monkeypatch):
    gate = hold_walks(monkeypatch)
    _unclean(tmp)
    tier = open_tier(tmp, recover_inline_bytes=0)
    assert tier.recovering()
    assert all(tier.put(k(100 + i), block(100 + i, 8192)) for i in range(3))
    tier.close()  # cancels the recovery: the three puts were accepted, never written
    assert sorted(tier.take_lost()) == sorted(k(100 + i) for i in range(3))
    gate.set()
    with open_tier(tmp) as again:  # and the records on disk are intact
        assert again.get_many([k(i) for i in range(20)]) == [block(i, 8192) for i in range(20)]


_SLOW_WALK = """
import sys, time
from kvstrata.tiers.ssd import SSDTier, walk
real = walk.child_command
walk.child_command = lambda code, *a: real("import time; time.sleep(120); " + code, *a)
tier = SSDTier(sys.argv[1], capacity_bytes=32 << 20, fingerprint="model-a/fp16/bs16",
               compression="none", recover_inline_bytes=0)
print("recovering", flush=True)
time.sleep(600)
"""


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                status = Path(f"/proc/{entry}/status").read_text()
            except OSError:
                continue
            if re.search(rf"^PPid:\s+{pid}$", status, re.M):
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0
    except OSError:
        return False


def test_a_sigkilled_owner_leaves_no_walk_running(tmp):
    _unclean(tmp)
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WALK, str(tmp)], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        assert proc.stdout.readline().strip() == "recovering"
        deadline = time.monotonic() + 30
        while not (walkers := _children(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert walkers, "the walk child did not start"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    deadline = time.monotonic() + 10
    while any(map(_alive, walkers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_alive, walkers)), "the walk outlived its owner"


def test_an_oversized_clean_snapshot_is_refused_unread(tmp, caplog):
    with open_tier(tmp) as tier:
        for i in range(5):
            assert tier.put(k(i), block(i, 8192))
    with open(tmp / "kvstrata.clean", "r+b") as f:  # a valid start, then a 256 MiB tail
        f.seek(256 * MiB)
        f.write(b"x")
    with caplog.at_level(logging.WARNING):
        t0 = time.monotonic()
        with open_tier(tmp) as tier:
            assert tier.get_many([k(i) for i in range(5)]) == [block(i, 8192) for i in range(5)]
        took = time.monotonic() - t0
    assert any("larger than a snapshot of this tier can be" in r.getMessage() for r in caplog.records)
    assert took < 20, took


def test_read_keys_of_a_tier_nobody_opened_creates_no_lock_file(tmp):
    with open_tier(tmp) as tier:
        assert tier.put(k(1), block(1, 8192))
    (tmp / "lock.mdb").unlink()  # as a copy of the directory, or after a rebuild, leaves it
    before = sorted(p.name for p in tmp.iterdir())
    assert read_keys(tmp, FP) == [k(1)]
    assert sorted(p.name for p in tmp.iterdir()) == before


def test_a_smaller_capacity_is_honoured_at_the_first_write_transaction(tmp):
    """What the README says: reads serve every record at once; the first transaction the
    writer commits (here: the recency of those reads) evicts down to the new capacity."""
    with open_tier(tmp, 32 * MiB) as tier:
        for i in range(200):
            assert tier.put(k(i), block(i, 65536))
    with open_tier(tmp, 4 * MiB) as tier:
        assert tier.stats()["current_bytes"] > 4 * MiB
        assert tier.get(k(199)) == block(199, 65536)
        assert tier.flush()
        assert tier.stats()["current_bytes"] <= 4 * MiB
        assert tier.get(k(199)) == block(199, 65536)  # the one just read is the most recent
        assert k(0) in tier.take_lost()
