"""The SSD tier's index: an LMDB environment (``data.mdb``) of small records.

Named databases:

* ``meta``: ``tierkv`` -> msgpack ``{format, created_at}``; ``state`` -> used
  bytes and the access clock (:data:`STATE`); ``ns:<prefix>`` -> msgpack
  ``{fingerprint, block_nbytes, compression, created_at}`` for every
  namespace ever opened.
* ``head``: namespaced key -> the record's head (header + payload tail, see
  :mod:`tierkv.tiers.ssd.record`).
* ``lru``: 8-byte big-endian access clock -> namespaced key; its first entry
  is the least recently used record. A record's live entry is the one at the
  clock in its header; an entry at another clock is stale (left by a head
  that did not verify) and is skipped.

A record becomes visible when its head is committed. Every change goes
through one write transaction (:meth:`Index.write`, a :class:`WriteTxn`),
which keeps the ``state`` record in step with the heads it adds and removes.
LMDB errors leave this module as :class:`IndexFailure` (:class:`MapFull`
when the map has no room), so no other part imports lmdb.

Threads: LMDB serialises write transactions itself; the tier's writer thread
(and recovery, before it starts) is the only one that opens them. Reads
(:meth:`Index.heads`, :meth:`Index.has`, :meth:`Index.keys_lru`,
:meth:`Index.used_bytes`) run in their own read transactions on any thread,
see a committed snapshot and need no lock. Never use an index across ``fork()``.
"""

from __future__ import annotations

import contextlib
import struct
from pathlib import Path
from typing import Any, Iterator, Sequence

from tierkv.tiers.ssd.record import CLOCK, HEADER, CorruptRecord, Encoded, Header, record_footprint

__all__ = ["Index", "WriteTxn", "IndexFailure", "MapFull", "DiskFull", "STATE", "MAX_KEY"]

STATE = struct.Struct("<QQ")   # used bytes, access clock
MAX_KEY = 511                   # LMDB's longest key (namespace prefix included)


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

    def __init__(self, path: Path, map_size: int, *, readonly: bool = False) -> None:
        import lmdb
        with _lmdb_errors():
            if readonly:  # one more reader beside the owner (a slot in lock.mdb), never a write
                self._env: Any = lmdb.open(str(path), subdir=True, max_dbs=8, readonly=True,
                                           create=False, readahead=False, mode=0o600)
            else:
                self._env = lmdb.open(str(path), map_size=map_size, subdir=True, max_dbs=8,
                                      sync=False, metasync=False, readahead=True,
                                      meminit=False, max_spare_txns=4, mode=0o600)
        self._meta: Any = None
        self._head: Any = None
        self._lru: Any = None

    # ------------------------------------------------------------------ open

    def names(self) -> list[bytes]:
        """Names in the main database (a tierkv environment holds only named databases)."""
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

    # ------------------------------------------------------------------ writes

    @contextlib.contextmanager
    def write(self) -> Iterator["WriteTxn"]:
        """A write transaction, committed (with the ``state`` record) when the block
        exits normally and aborted when it raises."""
        with _lmdb_errors(), self._env.begin(write=True, buffers=True) as txn:
            tx = WriteTxn(self._env, txn, self._meta, self._head, self._lru)
            yield tx
            tx.save_state()

    def sync(self) -> None:
        """Make every commit so far durable; clear the reader slots of dead processes (a
        killed reader, such as a :func:`tierkv.tiers.ssd.tier.read_keys` child, would pin
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
        are not verified here: a read does that)."""
        found: list[bytes] = []
        clock_of, unpack = Header.clock_of, CLOCK.unpack
        with _lmdb_errors(), self._env.begin(buffers=True) as txn:
            get, head_db = txn.get, self._head
            for clock, nskey in txn.cursor(db=self._lru).iternext():
                nskey = bytes(nskey)
                if not nskey.startswith(prefix):
                    continue
                head = get(nskey, db=head_db)
                if head is not None and len(head) >= HEADER.size and \
                        clock_of(head) == unpack(clock)[0]:
                    found.append(nskey)
        return found

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
    at commit; ``freed`` collects the page extents of deleted records.
    """

    def __init__(self, env: Any, txn: Any, meta: Any, head: Any, lru: Any) -> None:
        self._env, self._txn, self._meta, self._head, self._lru = env, txn, meta, head, lru
        state = txn.get(b"state", db=meta)
        self.used, self.clock = (0, 0) if state is None else STATE.unpack(state)
        self.freed: list[tuple[int, int]] = []

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
        """Delete every record (and the ``body`` database of record format 1); reset the state."""
        import lmdb
        for name in (b"head", b"lru", b"body"):
            try:
                db = self._env.open_db(name, txn=self._txn, create=False)
            except lmdb.NotFoundError:
                continue
            self._txn.drop(db, delete=name == b"body")
        self.used = self.clock = 0

    # ------------------------------------------------------------------ records

    def has(self, nskey: bytes) -> bool:
        return self._txn.get(nskey, db=self._head) is not None

    def heads(self) -> Iterator[tuple[bytes, bytes]]:
        """Every ``(nskey, head)``, in key order."""
        for nskey, head in self._txn.cursor(db=self._head).iternext():
            yield bytes(nskey), bytes(head)

    def insert(self, e: Encoded) -> None:
        """Add a new record as the most recently used one (its body is written)."""
        self.clock += 1
        self._txn.put(e.nskey, e.head(self.clock), db=self._head)
        self._txn.put(CLOCK.pack(self.clock), e.nskey, db=self._lru)
        self.used += e.footprint

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

    def _remove(self, nskey: bytes, head: bytes, hdr: Header | None, lru_gone: bool) -> int:
        self._txn.delete(nskey, db=self._head)
        if hdr is None:
            footprint = len(head)
        else:
            if not lru_gone:
                self._drop_lru(nskey, hdr.clock)
            if hdr.pages:
                self.freed.append((hdr.page, hdr.pages))
            footprint = record_footprint(len(nskey), hdr.payload_len)
        self.used -= footprint
        return footprint

    def _drop_lru(self, nskey: bytes, clock: int) -> None:
        key = CLOCK.pack(clock)
        if self._txn.get(key, db=self._lru) == nskey:
            self._txn.delete(key, db=self._lru)


def read_keys_lru(path: Path, prefix: bytes) -> list[bytes]:
    """:meth:`Index.keys_lru` of the environment at ``path``, opened read-only beside the
    process that owns it (empty if it has no tierkv databases yet). Raises
    :class:`IndexFailure`."""
    index = Index(path, 0, readonly=True)
    try:
        if b"head" not in index.names():
            return []
        index.open_dbs(create=False)
        return index.keys_lru(prefix)
    finally:
        index.close()


def _print_keys() -> None:
    """``python -c`` entry of :func:`tierkv.tiers.ssd.tier.read_keys`'s child: argv
    ``path prefix-hex``; the keys (msgpack) on stdout, exit 3 on an LMDB error."""
    import sys

    import msgpack
    try:
        keys = read_keys_lru(Path(sys.argv[1]), bytes.fromhex(sys.argv[2]))
    except IndexFailure as exc:
        print(exc, file=sys.stderr)
        sys.exit(3)
    sys.stdout.buffer.write(msgpack.packb(keys))
