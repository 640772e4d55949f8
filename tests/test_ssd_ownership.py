"""Whose directory it is: an operator command never deletes another program's data.

"Another program" is a real LMDB environment on disk, written with the ``lmdb``
module directly (100 records, no kvstrata meta record), in a directory of its own
or as the ``rank-0`` tier of an ``ssd.path``, sometimes with files named as
kvstrata names its own (``kvstrata.lock``, ``blocks.dat``, ...) left beside it.
Each command runs as the operator runs it (``python -m kvstrata.cli`` in a
process of its own) and must refuse in one line naming the path, exit 2, and
leave every file byte for byte as it was (``lock.mdb`` and mtimes included),
with its 100 records. ``read_keys`` (the scheduler's start-up read) refuses a tier
of the project's previous name without opening it for writing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import lmdb
import numpy as np
import pytest

from kvstrata.errors import ConfigError
from kvstrata.identity.fingerprint import PREVIOUS_NAME
from kvstrata.tiers.ssd import SSDTier
from kvstrata.tiers.ssd.tier import read_keys

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"
RECORDS = 100
FP = "model-a|fp16|tp0"
BLOCK = 4096


def foreign(path: Path, databases: tuple[bytes | None, ...] = (None,)) -> Path:
    """Another program's LMDB environment at ``path``: 100 records spread over
    ``databases`` (None: the main database), no kvstrata meta record."""
    path.mkdir(parents=True, exist_ok=True)
    env = lmdb.open(str(path), map_size=2**24, max_dbs=4)
    dbs = [env.open_db(name) if name is not None else None for name in databases]
    with env.begin(write=True) as txn:
        for i in range(RECORDS):
            txn.put(b"user:%04d" % i, b"their data %d" % i, db=dbs[i % len(dbs)])
    env.close()
    return path


def records(path: Path, databases: tuple[bytes | None, ...] = (None,)) -> int:
    """The other program's records still there (read on a copy: the original is not touched)."""
    copy = path.parent / (path.name + ".copy")
    shutil.copytree(path, copy)
    try:
        env = lmdb.open(str(copy), readonly=True, lock=False, max_dbs=4)
        with env.begin() as txn:
            n = sum(txn.stat(env.open_db(name, txn=txn, create=False))["entries"] if name is not None else
                    sum(1 for k, _ in txn.cursor() if k.startswith(b"user:")) for name in databases)
        env.close()
        return n
    finally:
        shutil.rmtree(copy)


def state(root: Path) -> dict[str, tuple[str, int, int]]:
    """Every file under ``root``: digest, mtime and size."""
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns,
                                      p.stat().st_size) for p in sorted(root.rglob("*")) if p.is_file()}


def kvstrata(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstrata.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def assert_refused(proc: subprocess.CompletedProcess[str], path: Path) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f" {path} holds an LMDB environment that kvstrata did not create" in proc.stderr, proc.stderr
    assert "deleted" not in proc.stdout


def fill(path: Path, n: int = 8) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with SSDTier(path, capacity_bytes=4 * 1024**2, fingerprint=FP, block_nbytes=BLOCK) as tier:
        for i in range(n):
            assert tier.put(i.to_bytes(32, "big"), np.full(BLOCK, i, dtype=np.uint8))
        assert tier.flush()


STRAYS = {"none": (), "blocks.dat": ("blocks.dat",), "kvstrata.lock": ("kvstrata.lock",),
          "every kvstrata name": ("kvstrata.lock", "blocks.dat", "kvstrata.clean"),
          "the previous name's lock": (f"{PREVIOUS_NAME}.lock",)}


@pytest.mark.parametrize("layout", ["directory", "ssd.path"])
@pytest.mark.parametrize("strays", list(STRAYS), ids=list(STRAYS))
def test_purge_all_refuses_another_programs_lmdb(tmp_path: Path, layout: str, strays: str) -> None:
    root = tmp_path / "theirs"
    db = foreign(root if layout == "directory" else root / "rank-0")
    for name in STRAYS[strays]:
        (db / name).write_bytes(b"their %s\n" % name.encode())
    before = state(root)
    assert_refused(kvstrata("ssd", "purge", str(root), "--all"), db)
    assert state(root) == before
    assert records(db) == RECORDS


@pytest.mark.parametrize("mode", [["--older-than", "1h"], ["--namespace", "user:000"], ["--all-but", "12345678"]])
def test_every_purge_mode_refuses_it_even_with_a_kvstrata_lock_beside(tmp_path: Path, mode: list[str]) -> None:
    """A lock file of kvstrata's name proves nothing: the environment's meta record decides."""
    db = foreign(tmp_path / "theirs")
    (db / "kvstrata.lock").write_bytes(b"")
    before = state(db)
    assert_refused(kvstrata("ssd", "purge", str(db), *mode), db)
    assert state(db) == before and records(db) == RECORDS


def test_verify_drop_refuses_it(tmp_path: Path) -> None:
    db = foreign(tmp_path / "theirs")
    (db / "kvstrata.lock").write_bytes(b"")
    (db / "blocks.dat").write_bytes(b"\0" * 8192)
    before = state(db)
    assert_refused(kvstrata("ssd", "verify", str(db), "--drop"), db)
    assert state(db) == before and records(db) == RECORDS


def test_a_program_with_a_database_named_meta_is_not_taken_for_a_tier(tmp_path: Path) -> None:
    """Databases named as kvstrata names its own, holding another program's records."""
    dbs = (b"meta", b"head")
    db = foreign(tmp_path / "theirs", dbs)
    (db / "kvstrata.lock").write_bytes(b"")
    before = state(db)
    assert_refused(kvstrata("ssd", "purge", str(db), "--all"), db)
    with pytest.raises(ConfigError, match="did not create"):
        SSDTier(db, capacity_bytes=4 * 1024**2, fingerprint=FP, block_nbytes=BLOCK)
    assert state(db) == before and records(db, dbs) == RECORDS


def test_a_plain_record_named_meta_is_not_taken_for_a_tier(tmp_path: Path) -> None:
    db = foreign(tmp_path / "theirs")
    env = lmdb.open(str(db), map_size=2**24)
    with env.begin(write=True) as txn:
        txn.put(b"meta", b"their settings")
    env.close()
    (db / "kvstrata.lock").write_bytes(b"")
    before = state(db)
    assert_refused(kvstrata("ssd", "purge", str(db), "--all"), db)
    assert state(db) == before and records(db) == RECORDS


def test_opening_a_tier_on_it_is_refused_whatever_lies_beside(tmp_path: Path) -> None:
    db = foreign(tmp_path / "theirs")
    for name in ("kvstrata.lock", "blocks.dat", "kvstrata.clean"):
        (db / name).write_bytes(b"their file\n")
    before = state(db)
    with pytest.raises(ConfigError, match=f"^path: {db} holds an LMDB environment that kvstrata did not create"):
        SSDTier(db, capacity_bytes=4 * 1024**2, fingerprint=FP, block_nbytes=BLOCK)
    assert state(db) == before and records(db) == RECORDS


def test_an_unreadable_data_mdb_is_never_deleted_on_a_lock_files_word(tmp_path: Path) -> None:
    """Nothing can say whose a data.mdb LMDB cannot read is: kvstrata's lock beside it is no
    proof, so purge refuses it (a tier opening it leaves it to recovery, which verifies)."""
    db = tmp_path / "unknown"
    db.mkdir()
    (db / "data.mdb").write_bytes(np.random.default_rng(0).integers(0, 256, 65536, dtype=np.uint8).tobytes())
    for name in ("kvstrata.lock", "blocks.dat"):
        (db / name).write_bytes(b"")
    before = state(db)
    for mode in (["--all"], ["--older-than", "0s"]):
        proc = kvstrata("ssd", "purge", str(db), *mode)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"{db}/data.mdb cannot be read" in proc.stderr and "nothing deleted" in proc.stderr
        assert state(db) == before


def test_one_foreign_rank_refuses_the_purge_of_every_rank(tmp_path: Path) -> None:
    """Nothing anywhere changes: rank 0, a real tier, is not purged before rank 1 is refused."""
    root = tmp_path / "ssd"
    fill(root / "rank-0")
    foreign(root / "rank-1")
    before = state(root)
    for mode in (["--all"], ["--older-than", "0s"]):
        assert_refused(kvstrata("ssd", "purge", str(root), *mode), root / "rank-1")
        assert state(root) == before
    assert records(root / "rank-1") == RECORDS


def test_a_real_tier_still_purges(tmp_path: Path) -> None:
    root = tmp_path / "ssd"
    fill(root / "rank-0")
    fill(root / "rank-1", 3)
    (root / "rank-0" / "notes.txt").write_text("operator's")
    proc = kvstrata("ssd", "purge", str(root), "--all")
    assert proc.returncode == 0 and proc.stdout.count("deleted every block") == 2, proc.stderr
    assert os.listdir(root / "rank-0") == ["notes.txt"] and os.listdir(root / "rank-1") == []


# ---------------------------------------------------------------- read_keys

@pytest.fixture
def previous(tmp_path: Path) -> Path:
    with tarfile.open(DATA / "previous_ssd_tier.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    return tmp_path / "tier"


def test_read_keys_refuses_a_previous_name_tier_and_changes_nothing(previous: Path) -> None:
    assert (previous / "lock.mdb").exists()  # left by the release that wrote it: LMDB would rewrite it
    before = state(previous)
    with pytest.raises(OSError, match=f"written by {PREVIOUS_NAME}"):
        read_keys(previous, "previous-release-fixture")
    assert state(previous) == before


def test_read_keys_refuses_another_programs_lmdb_and_changes_nothing(tmp_path: Path) -> None:
    db = foreign(tmp_path / "theirs")
    (db / "kvstrata.lock").write_bytes(b"")
    before = state(db)
    with pytest.raises(OSError, match="did not create"):
        read_keys(db, FP)
    assert state(db) == before and records(db) == RECORDS


def test_read_keys_of_a_closed_tier_writes_nothing(tmp_path: Path) -> None:
    """No owner runs: the keys are read without a reader slot, so even lock.mdb stays as it was."""
    fill(tmp_path / "t", 5)
    before = state(tmp_path / "t")
    assert read_keys(tmp_path / "t", FP) == [i.to_bytes(32, "big") for i in range(5)]
    assert state(tmp_path / "t") == before
