"""The SSD tier's index: an LMDB environment (``data.mdb``) of small records.

Named databases:

* ``meta``: ``kvstrata`` -> msgpack ``{format, created_at}``; ``state`` -> used
  bytes and the access clock (:data:`STATE`); ``ns:<prefix>`` -> msgpack
  ``{fingerprint, block_nbytes, compression, created_at}`` for every
  namespace ever opened.
* ``head``: namespaced key -> the record's head (header + payload tail, see
  :mod:`kvstrata.tiers.ssd.record`).
* ``meta`` also holds time marks: ``t:`` + 8-byte big-endian clock -> the wall time
  (``<d``) by which every access up to that clock had happened; the writer adds one
  at most a minute apart (:meth:`WriteTxn.mark_time`), so a record's last use is
  known to the minute (``kvstrata ssd stats``, ``purge --older-than``).
* ``tag``: namespaced key -> what the writer of the record keeps beside it (optional,
  a few hundred bytes at most: the vLLM plugin keeps a block's tokens there, to announce
  it after a restart); written and deleted with the record's head.
* ``lru``: 8-byte big-endian access clock -> namespaced key; its first entry
  is the least recently used record. A record's live entry is the one at the
  clock in its header; an entry at another clock is stale (left by a head
  that did not verify) and is skipped.

A record becomes visible when its head is committed. Every change goes
through one write transaction (:meth:`Index.write`, a :class:`WriteTxn`),
which keeps the ``state`` record in step with the heads it adds and removes.
LMDB errors leave this module as :class:`IndexFailure` (:class:`MapFull`
when the map has no room), so no other part of the tier imports lmdb (the
integrity check's child process does, :mod:`~kvstrata.tiers.ssd.walk`).

Listing keys works in bulk (:meth:`Index.keys_lru`): the heads of a
namespace are read in large chunks, without LMDB's buffer objects (far
slower per entry than bytes), and ordered by the clock in their headers with
numpy; :func:`pack_keys` puts them in one buffer for a process that reads
them beside the owner.

Threads: LMDB serialises write transactions itself; the tier's writer thread
(and recovery, before it starts) is the only one that opens them. Reads
(:meth:`Index.heads`, :meth:`Index.has`, :meth:`Index.keys_lru`,
:meth:`Index.all_heads`, :meth:`Index.used_bytes`) run in their own read
transactions on any thread, see a committed snapshot and need no lock. Never
use an index across ``fork()``.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter
import struct
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from kvstrata.tiers.ssd.record import (CLOCK, HEAD_DTYPE, HEADER, NS_LEN, CorruptRecord, Encoded,
                                     Header, record_footprint)

__all__ = ["Index", "WriteTxn", "IndexFailure", "MapFull", "DiskFull", "STATE", "TIME_MARK", "MARK_PREFIX",
           "MAX_KEY",
           "prefix_counts"]

STATE = struct.Struct("<QQ")   # used bytes, access clock
TIME_MARK = struct.Struct("<d")  # a time mark's value: seconds since the epoch
MARK_PREFIX = b"t:"              # + CLOCK: a time mark's key in ``meta``
MAX_KEY = 511                   # LMDB's longest key (namespace prefix included)
CHUNK = 65536                   # entries read per call when listing a whole database


class IndexFailure(Exception):
    """The LMDB environment failed (corruption, I/O error, use after fork)."""


class MapFull(IndexFailure):
    """The LMDB map has no room for a transaction (make room and retry)."""


class DiskFull(IndexFailure):
    """The disk had no room for a write (the transaction was aborted; the environment
    stays usable)."""


@contextlib.contextmanager
def _lmdb_errors() -> Iterator[None]:
    import lmdb
    try:
        yield
    except lmdb.MapFullError as exc:
        raise MapFull(f"{type(exc).__name__}: {exc}") from exc
    except lmdb.DiskError as exc:
        raise DiskFull(f"{type(exc).__name__}: {exc}") from exc
    except lmdb.Error as exc:
        raise IndexFailure(f"{type(exc).__name__}: {exc}") from exc


def parse_head(head: bytes) -> Header | None:
    """The header of a head entry, or None if it does not verify."""
    try:
        return Header.unpack(head)
    except CorruptRecord:
        return None


class Index:
    """The LMDB environment at ``path`` with a map of ``map_size`` bytes."""

    def __init__(self, path: Path, map_size: int, *, readonly: bool = False, lock: bool | None = None) -> None:
        import lmdb

        from kvstrata.tiers.ssd.owner import reader_slot
        with _lmdb_errors():
            if readonly:  # one more reader beside the owner (a slot in its lock.mdb), never a
                # write. ``lock=None``: a slot only while an owner runs (holds kvstrata.lock):
                # with none, LMDB would rewrite lock.mdb; without a slot not a byte changes
                self._env: Any = lmdb.open(str(path), subdir=True, max_dbs=8, readonly=True,
                                           create=False, readahead=False, mode=0o600,
                                           lock=reader_slot(path) if lock is None else lock)
            else:
                self._env = lmdb.open(str(path), map_size=map_size, subdir=True, max_dbs=8,
                                      sync=False, metasync=False, readahead=True,
                                      meminit=False, max_spare_txns=4, mode=0o600)
        self._meta: Any = None
        self._head: Any = None
        self._lru: Any = None
        self._tag: Any = None

    # ------------------------------------------------------------------ open

    def names(self) -> list[bytes]:
        """Names in the main database (a kvstrata environment holds only named databases)."""
        with _lmdb_errors(), self._env.begin() as txn:
            return list(txn.cursor().iternext(values=False))

    def data_end(self) -> int:
        """Bytes ``data.mdb`` must have to hold every page the environment uses."""
        with _lmdb_errors():
            return int((self._env.info()["last_pgno"] + 1) * self._env.stat()["psize"])

    def open_dbs(self, create: bool = True) -> None:
        with _lmdb_errors():
            self._meta = self._env.open_db(b"meta", create=create)
            self._head = self._env.open_db(b"head", create=create)
            self._lru = self._env.open_db(b"lru", create=create)
            if create or b"tag" in self.names():  # (an index written before tags had none)
                self._tag = self._env.open_db(b"tag", create=create)

    # ------------------------------------------------------------------ writes

    @contextlib.contextmanager
    def write(self) -> Iterator["WriteTxn"]:
        """A write transaction, committed (with the ``state`` record) when the block
        exits normally and aborted when it raises."""
        with _lmdb_errors(), self._env.begin(write=True, buffers=True) as txn:
            tx = WriteTxn(self._env, txn, self._meta, self._head, self._lru, self._tag)
            yield tx
            tx.save_state()

    def sync(self) -> None:
        """Make every commit so far durable; clear the reader slots of dead processes (a
        killed reader, such as a :func:`kvstrata.tiers.ssd.tier.read_keys` child, would pin
        the pages of its snapshot and make the file grow)."""
        with _lmdb_errors():
            self._env.sync(True)
        self.clear_stale_readers()

    def clear_stale_readers(self) -> None:
        try:
            with _lmdb_errors():
                self._env.reader_check()
        except IndexFailure:
            pass  # only pages stay pinned longer

    def close(self) -> None:
        self._env.close()

    # ------------------------------------------------------------------ reads

    def has(self, nskey: bytes) -> bool:
        """True if ``nskey`` has a committed head; False also when the read fails."""
        try:
            with _lmdb_errors(), self._env.begin(buffers=True) as txn:
                return txn.get(nskey, db=self._head) is not None
        except IndexFailure:
            return False

    def heads(self, nskeys: Sequence[bytes], look: Sequence[bool]) -> list[bytes | None]:
        """The head entry of every key with ``look[i]`` (None: absent or not looked up),
        from one snapshot."""
        with _lmdb_errors(), self._env.begin(buffers=True) as txn:
            get, db = txn.get, self._head
            heads = [get(k, db=db) if want else None for k, want in zip(nskeys, look)]
            return [None if h is None else bytes(h) for h in heads]

    def head(self, nskey: bytes) -> Header | None:
        """The verified header of ``nskey``'s record, or None."""
        head = self.heads([nskey], [True])[0]
        return None if head is None else parse_head(head)

    def keys_lru(self, prefix: bytes) -> list[bytes]:
        """Keys starting with ``prefix`` that have a head, least recently used first (heads
        are not verified here: a read does that). In bulk: the heads of the prefix, ordered
        by the access clock in their headers (a record's live LRU entry is at that clock)."""
        with _lmdb_errors(), self._env.begin() as txn:
            nskeys, heads = _range(txn.cursor(db=self._head), prefix)
        return [nskeys[i] for i in _by_clock(heads)]

    def tags(self, prefix: bytes) -> tuple[list[bytes], list[bytes]]:
        """Every ``(nskey, tag)`` of keys starting with ``prefix``, as two lists in key order."""
        if self._tag is None:
            return [], []
        with _lmdb_errors(), self._env.begin() as txn:
            return _range(txn.cursor(db=self._tag), prefix)

    def meta_items(self) -> dict[bytes, bytes]:
        """Every record of the ``meta`` database (the format record, the state, one per
        namespace); empty where there is none."""
        if self._meta is None:
            return {}
        with _lmdb_errors(), self._env.begin() as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor(db=self._meta)}

    def all_heads(self) -> tuple[list[bytes], list[bytes]]:
        """Every ``(nskey, head)`` of the index, as two lists in key order (one snapshot)."""
        with _lmdb_errors(), self._env.begin() as txn:
            return _range(txn.cursor(db=self._head), b"")

    def used_bytes(self) -> int:
        """Bytes of stored records as last committed (0 if unreadable)."""
        try:
            with _lmdb_errors(), self._env.begin() as txn:
                return int(STATE.unpack(txn.get(b"state", db=self._meta))[0])
        except (IndexFailure, TypeError, struct.error):
            return 0


class WriteTxn:
    """Changes to the index inside one write transaction (see :meth:`Index.write`).

    ``used`` and ``clock`` start from the ``state`` record and are stored back
    at commit; ``freed`` collects the page extents of deleted records; ``counts``
    the change in records per namespace; ``leaked`` is set when a deleted head
    did not verify (its pages, unknown, stay taken until the next rebuild).
    """

    def __init__(self, env: Any, txn: Any, meta: Any, head: Any, lru: Any, tag: Any = None) -> None:
        self._env, self._txn, self._meta, self._head, self._lru = env, txn, meta, head, lru
        self._tag = tag
        state = txn.get(b"state", db=meta)
        self.used, self.clock = (0, 0) if state is None else STATE.unpack(state)
        self.freed: list[tuple[int, int]] = []
        self.counts: dict[bytes, int] = {}
        self.leaked = False

    def save_state(self) -> None:
        self._txn.put(b"state", STATE.pack(max(self.used, 0), self.clock), db=self._meta)

    # ------------------------------------------------------------------ meta

    def meta(self, key: bytes) -> bytes | None:
        value = self._txn.get(key, db=self._meta)
        return None if value is None else bytes(value)

    def put_meta(self, key: bytes, value: bytes) -> None:
        self._txn.put(key, value, db=self._meta)

    def records(self) -> int:
        """Heads in the index (of every namespace)."""
        return int(self._txn.stat(self._head)["entries"])

    def drop_all(self) -> None:
        """Delete every record (and the ``body`` database of record format 1) and the time
        marks; reset the state."""
        import lmdb
        for key in self._marks():
            self._txn.delete(key, db=self._meta)
        for name in (b"head", b"lru", b"tag", b"body"):
            try:
                db = self._env.open_db(name, txn=self._txn, create=False)
            except lmdb.NotFoundError:
                continue
            self._txn.drop(db, delete=name == b"body")
        self.used = self.clock = 0

    def mark_time(self, now: float) -> None:
        """Every access so far (clock up to :attr:`clock`) happened by ``now``. Marks no
        record needs go: all but the newest of those below the oldest record's clock."""
        self._txn.put(MARK_PREFIX + CLOCK.pack(self.clock), TIME_MARK.pack(now), db=self._meta)
        cur = self._txn.cursor(db=self._lru)
        oldest = CLOCK.unpack(bytes(cur.key()))[0] if cur.first() else self.clock
        below = [k for k in self._marks() if CLOCK.unpack(k[len(MARK_PREFIX):])[0] < oldest]
        for key in below[:-1]:
            self._txn.delete(key, db=self._meta)

    def _marks(self) -> list[bytes]:
        """The time marks' keys, oldest first."""
        cur = self._txn.cursor(db=self._meta)
        out: list[bytes] = []
        if cur.set_range(MARK_PREFIX):
            for key in cur.iternext(values=False):
                key = bytes(key)
                if not key.startswith(MARK_PREFIX):
                    break
                if len(key) == len(MARK_PREFIX) + CLOCK.size:  # (a damaged key is left alone)
                    out.append(key)
        return out

    # ------------------------------------------------------------------ records

    def has(self, nskey: bytes) -> bool:
        return self._txn.get(nskey, db=self._head) is not None

    def present(self, nskeys: Sequence[bytes]) -> set[bytes]:
        """Those of ``nskeys`` that have a head (looked up in one call)."""
        if not nskeys:
            return set()
        return {bytes(k) for k, _ in self._txn.cursor(db=self._head).getmulti(nskeys)}

    def heads(self) -> Iterator[tuple[bytes, bytes]]:
        """Every ``(nskey, head)``, in key order."""
        for nskey, head in self._txn.cursor(db=self._head).iternext():
            yield bytes(nskey), bytes(head)

    def insert(self, e: Encoded) -> None:
        """Add a new record as the most recently used one (its body is written)."""
        self.insert_many([e])

    def insert_many(self, records: Sequence[Encoded]) -> None:
        """Add new records (absent from the index, bodies written) as the most recently
        used ones, in order: heads in key order and LRU entries appended, each set in one
        call."""
        clock = self.clock
        heads: list[tuple[bytes, bytes]] = []
        lru: list[tuple[bytes, bytes]] = []
        pack = CLOCK.pack
        for e in records:
            clock += 1
            heads.append((e.nskey, e.head(clock)))
            lru.append((pack(clock), e.nskey))
        heads.sort()
        self._txn.cursor(db=self._head).putmulti(heads)
        tags = sorted((e.nskey, e.tag) for e in records if e.tag)
        if tags and self._tag is not None:
            self._txn.cursor(db=self._tag).putmulti(tags)
        added = self._txn.cursor(db=self._lru).putmulti(lru, append=True)[1]
        if added != len(lru):  # an entry at or past this clock (a damaged state record)
            self._txn.cursor(db=self._lru).putmulti(lru)
        self.clock = clock
        self.used += sum(e.footprint for e in records)
        for ns, n in prefix_counts([e.nskey for e in records]).items():
            self.counts[ns] = self.counts.get(ns, 0) + n

    def delete(self, nskey: bytes) -> int:
        """Remove a record, its body extent going to ``freed``; return its footprint
        (0 if absent). A head that does not verify frees no pages (they come back at
        the next open, which rebuilds the free-space map)."""
        head = self._txn.get(nskey, db=self._head)
        if head is None:
            return 0
        head = bytes(head)
        return self._remove(nskey, head, parse_head(head), lru_gone=False)

    def drop(self, nskey: bytes) -> None:
        """Remove a record without accounting for it (recovery recounts from scratch)."""
        head = self._txn.get(nskey, db=self._head)
        if head is not None:
            hdr = parse_head(bytes(head))
            self._txn.delete(nskey, db=self._head)
            self._drop_tag(nskey)
            if hdr is not None:
                self._drop_lru(nskey, hdr.clock)

    def evict(self, target: int) -> list[bytes]:
        """Remove least recently used records until ``used <= target``; return their keys."""
        self.used = max(self.used, 0)
        cur = self._txn.cursor(db=self._lru)
        evicted: list[bytes] = []
        while self.used > target and cur.first():
            clock = CLOCK.unpack(cur.key())[0]
            nskey = bytes(cur.value())
            cur.delete()
            head = self._txn.get(nskey, db=self._head)
            if head is None:
                continue
            head = bytes(head)
            hdr = parse_head(head)
            if hdr is not None and hdr.clock != clock:
                continue  # a stale entry: the record lives on at its own clock
            self._remove(nskey, head, hdr, lru_gone=True)
            evicted.append(nskey)
        return evicted

    def retouch(self, nskey: bytes) -> None:
        """Make a record the most recently used one (nothing if absent or unverifiable)."""
        head = self._txn.get(nskey, db=self._head)
        if head is None:
            return
        head = bytes(head)
        hdr = parse_head(head)
        if hdr is None:
            return  # a read will find it and have it deleted
        self._drop_lru(nskey, hdr.clock)
        self.clock += 1
        self._txn.put(nskey, hdr.with_clock(self.clock).pack() + head[HEADER.size:],
                      db=self._head)
        self._txn.put(CLOCK.pack(self.clock), nskey, db=self._lru)

    def _count(self, nskey: bytes, n: int) -> None:
        ns = nskey[:NS_LEN]
        self.counts[ns] = self.counts.get(ns, 0) + n

    def _remove(self, nskey: bytes, head: bytes, hdr: Header | None, lru_gone: bool) -> int:
        self._txn.delete(nskey, db=self._head)
        self._drop_tag(nskey)
        self._count(nskey, -1)
        if hdr is None:
            self.leaked = True
            footprint = len(head)
        else:
            if not lru_gone:
                self._drop_lru(nskey, hdr.clock)
            if hdr.pages:
                self.freed.append((hdr.page, hdr.pages))
            footprint = record_footprint(len(nskey), hdr.payload_len)
        self.used -= footprint
        return footprint

    def _drop_tag(self, nskey: bytes) -> None:
        if self._tag is not None:
            self._txn.delete(nskey, db=self._tag)

    def _drop_lru(self, nskey: bytes, clock: int) -> None:
        key = CLOCK.pack(clock)
        if self._txn.get(key, db=self._lru) == nskey:
            self._txn.delete(key, db=self._lru)


def prefix_counts(nskeys: Sequence[bytes]) -> dict[bytes, int]:
    """Keys per namespace prefix."""
    return dict(Counter(k[:NS_LEN] for k in nskeys))


def _range(cursor: Any, prefix: bytes) -> tuple[list[bytes], list[bytes]]:
    """Keys and values from the first key at or after ``prefix`` while keys start with it:
    keys, then values, read :data:`CHUNK` per call (a transaction without buffers: bytes
    objects come far cheaper than LMDB's buffer objects)."""
    keys: list[bytes] = []
    if not cursor.set_range(prefix):
        return keys, []
    names = cursor.iternext(values=False)
    while True:
        chunk = list(itertools.islice(names, CHUNK))
        if chunk and not chunk[-1].startswith(prefix):
            chunk = list(itertools.takewhile(lambda k: k.startswith(prefix), chunk))
        keys.extend(chunk)
        if len(chunk) < CHUNK:
            break
    cursor.set_range(prefix)
    return keys, list(itertools.islice(cursor.iternext(keys=False), len(keys)))


def _by_clock(heads: Sequence[bytes]) -> list[int]:
    """Positions of the heads long enough to carry a header, by their access clock."""
    lengths = np.fromiter(map(len, heads), np.int64, len(heads))
    clocks = np.array(heads, dtype=f"S{HEADER.size}").view(HEAD_DTYPE)["clock"]  # cut or padded
    ok = np.flatnonzero(lengths >= HEADER.size)
    return ok[np.argsort(clocks[ok], kind="stable")].tolist()
