"""The SSD tier: a capacity-bounded, checksummed, crash-safe block store.

Two files under ``path``:

* ``blocks.dat``: the payloads, each in a run of whole 4 KiB pages written
  with ``pwrite`` straight from the encoded block (no intermediate copy, no
  page headers), allocated best-fit by :class:`tierkv.extents.ExtentMap`.
* ``data.mdb``: an LMDB environment, the index (named databases):

  * ``meta``: ``tierkv`` -> msgpack ``{format, created_at}``; ``state`` ->
    used bytes and the access clock; ``ns:<prefix>`` -> msgpack
    ``{fingerprint, block_nbytes, compression, created_at}`` for every
    namespace ever opened.
  * ``head``: namespaced key -> 44-byte record header (first page, lengths,
    checksum, access clock) + a short payload tail, see :mod:`tierkv.codec`.
  * ``lru``: 8-byte big-endian access clock -> namespaced key; its first
    entry is the least recently used record.

A record becomes visible when its head is committed, after its body was
written. Pages of a deleted or evicted record are reused only once the
deletion is synced to disk and no reader that could still hold the old head
is running, so a crash or a concurrent read never pairs a head with another
record's bytes (and if the disk reorders writes anyway, the checksum catches
it). Pages of ``blocks.dat`` that no head points to (a crash between
``pwrite`` and commit) are free again at the next open, which rebuilds the
free-space map from the heads.

Fingerprints get separate namespaces: every key is stored under a 16-byte
prefix derived from the format version and the fingerprint, so blocks of
another fingerprint are never visible; they age out through the shared LRU.

Writes are asynchronous: :meth:`SSDTier.put` copies the block into a queue
bounded by bytes and returns; one writer thread encodes, evicts and commits
many blocks per write transaction, then syncs both files. Reads verify the header and an
``xxh3_64`` checksum; a record that does not verify is deleted and reported
as a miss. Failures of the environment (corruption, I/O errors, use after
``fork()``) are logged once with the path and degrade the tier to misses and
dropped puts; they never raise to the caller.

Thread-safety: ``get``, ``get_many``, ``__contains__``, ``keys`` and ``stats``
may be called from any thread; ``put`` from any thread; ``flush`` and
``close`` from the owner. Never use a tier across ``fork()``: a child process
sees it as disabled and must open its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from tierkv.codec import (HEADER, PAGE, RAW, RECORD_VERSION, Codec, CorruptRecord, Header,
                          body_pages, checksum, split_tail)
from tierkv.errors import ConfigError
from tierkv.extents import ExtentMap

__all__ = ["SSDTier"]

log = logging.getLogger(__name__)

_STATE = struct.Struct("<QQ")   # used bytes, access clock
_CLOCK = struct.Struct(">Q")    # big endian: LMDB key order == clock order
_NODE = 10                      # LMDB leaf node header + index slot, per record
_NS_LEN = 16
_MAX_TOUCHED = 1 << 16          # pending recency updates kept between writer batches
_TOUCH_INTERVAL_S = 1.0
_LINGER_S = 0.005               # a writer that woke on one put waits this long for a batch to fill
_EAGER_BYTES = 1024**2          # ... or until this much is queued
_CODER_THREADS = min(4, os.cpu_count() or 1)  # threads (de)compressing one batch
_SYNC_BYTES = 64 * 1024**2      # unsynced commits are synced at a flush, past this many bytes,
_SYNC_INTERVAL_S = 1.0          # or after this long
_MAX_ATTEMPTS = 4
_OPEN_PATHS: set[str] = set()   # LMDB forbids opening one environment twice in a process
_OPEN_LOCK = threading.Lock()
_CLEAN = "tierkv.clean"         # written by close(); its absence at open means an unclean shutdown
_BLOCKS = "blocks.dat"          # the payloads

# Run in a child: every page the B-tree reaches is read, and every value must lie
# inside data.mdb (checked by address, without reading overflow pages).
_WALK = r"""
import os, sys, lmdb, numpy as np
path = sys.argv[1]
env = lmdb.open(path, readonly=True, lock=False, max_dbs=8, readahead=False)
data = os.path.realpath(os.path.join(path, "data.mdb"))
lo = hi = None
with open("/proc/self/maps") as maps:
    for line in maps:
        if line.rstrip().endswith(data):
            lo = int(line.split("-")[0], 16)
            break
if lo is not None:
    hi = lo + os.path.getsize(data)
with env.begin(buffers=True) as txn:
    names = [bytes(k) for k in txn.cursor().iternext(values=False)]
    if names and b"meta" not in names:
        sys.exit(4)  # not a tierkv environment: the caller refuses it without writing
    for name in names:
        db = env.open_db(name, txn=txn, create=False)
        for k, v in txn.cursor(db=db).iternext():
            if lo is not None and len(v):
                at = np.frombuffer(v, dtype=np.uint8).ctypes.data
                if not (lo <= at and at + len(v) <= hi):
                    sys.exit(3)
"""


def _walk_in_subprocess(path: Path, timeout: float = 600.0) -> str | None:
    """None if a child process can walk the whole environment; otherwise what went wrong."""
    import subprocess
    import sys
    try:
        proc = subprocess.run([sys.executable, "-c", _WALK, str(path)], capture_output=True,
                              text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"verification did not finish: {exc}"
    if proc.returncode in (0, 4):
        return None
    if proc.returncode < 0:
        return f"walking it killed a process with signal {-proc.returncode}"
    if proc.returncode == 3:
        return "a value points past the end of data.mdb"
    return (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1]


def record_footprint(key_len: int, payload_len: int) -> int:
    """Bytes one record occupies, as counted against the capacity.

    The body's whole pages in the block file, plus the head record (header and
    tail) and the LRU entry in the index.
    """
    tail = split_tail(payload_len)
    return (body_pages(payload_len, tail) * PAGE + (key_len + HEADER.size + tail + _NODE)
            + (_CLOCK.size + key_len + _NODE))


def namespace_of(fingerprint: bytes) -> bytes:
    """The 16-byte key prefix of a fingerprint (changes with the record format version)."""
    return hashlib.blake2b(b"tierkv/%d/" % RECORD_VERSION + fingerprint,
                           digest_size=_NS_LEN).digest()


class _Encoded:
    """A block ready to be written: header, body, tail and footprint."""

    __slots__ = ("nskey", "header", "body", "tail", "footprint", "raw_len")

    def __init__(self, nskey: bytes, raw: bytes, codec: Codec) -> None:
        kind, payload = codec.encode(raw)
        ntail = split_tail(len(payload))
        view = memoryview(payload)
        self.nskey = nskey
        self.raw_len = len(raw)
        self.body = view[:len(payload) - ntail]
        self.tail = bytes(view[len(payload) - ntail:])
        self.header = Header(kind, len(raw), len(payload), ntail, checksum(nskey, raw), 0)
        self.footprint = record_footprint(len(nskey), len(payload))

    @property
    def pages(self) -> int:
        return self.header.pages

    def head(self, clock: int) -> bytes:
        return self.header.with_clock(clock).pack() + self.tail


class SSDTier:
    """Blocks on SSD in an LMDB environment, bounded by bytes, evicted LRU.

    Parameters: ``path`` (a directory whose parent exists; created if
    missing; must be empty or hold a tierkv environment), ``capacity_bytes``
    (hard bound on the bytes of stored records, page rounding included),
    ``fingerprint`` (str or bytes identifying model + KV layout + dtype + block
    size), ``compression`` (``"auto"``, ``"zstd"`` or ``"none"``), ``level``
    (zstd level), ``queue_capacity_bytes`` (puts beyond this much unwritten
    data are dropped), ``block_nbytes`` (when given, every block must have
    exactly this size).

    Each file stays below ``capacity_bytes + slack_bytes``: the block file's
    free-space map never hands out pages past that, and it is the LMDB map
    size. The slack holds pages freed but not yet reusable (see the module
    docstring) and fragmentation; the index itself is small (about 200 bytes
    per record).
    """

    def __init__(self, path: str | os.PathLike[str], *, capacity_bytes: int,
                 fingerprint: str | bytes, compression: str = "auto", level: int = 1,
                 queue_capacity_bytes: int = 256 * 1024**2,
                 block_nbytes: int | None = None) -> None:
        self.path = _check_path(path)
        self.block_nbytes = _check_block_nbytes(block_nbytes)
        self.capacity_bytes = _check_capacity(capacity_bytes, self.block_nbytes)
        self.fingerprint = _check_fingerprint(fingerprint)
        self.queue_capacity_bytes = _check_int(queue_capacity_bytes, "queue_capacity_bytes", 1)
        self._codec = Codec(compression, level)
        self.compression = compression
        self.batch_bytes = min(16 * 1024**2, max(self.capacity_bytes // 16, 256 * 1024))
        self.slack_bytes = self.capacity_bytes // 16 + 4 * self.batch_bytes + 4 * 1024**2
        self._ns = namespace_of(self.fingerprint)
        self._pid = os.getpid()
        self._init_state()
        self._env: Any = None
        self._fd = -1
        self._coders: Any = None  # thread pool for (de)compression, made on first use
        self._register_path()
        try:
            self._open()
        except BaseException:
            self._unregister_path()
            raise
        self._writer = threading.Thread(target=self._writer_loop, daemon=True,
                                        name=f"tierkv-ssd-writer:{self.path.name}")
        self._writer.start()

    # ================================================================== open

    def _init_state(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[tuple[bytes, bytes]] = deque()
        self._pending: dict[bytes, bytes | bytearray] = {}
        self._spare: dict[int, list[bytearray]] = {}  # copy buffers for reuse, by size
        self._spare_bytes = 0
        self._queued_bytes = 0
        self._touched: dict[bytes, None] = {}
        self._bad: dict[bytes, int] = {}
        self._flush_req = 0
        self._flush_done = 0
        self._unsynced = 0
        self._last_sync = time.monotonic()
        self._extents = ExtentMap(0)
        self._quarantine: list[tuple[int, list[tuple[int, int]]]] = []  # (commit, extents)
        self._commits = 0            # write transactions committed since open
        self._synced_commits = 0     # ... of which are synced to disk
        self._readers: dict[int, int] = {}  # commit count when a read began -> reads running
        self._read_lock = threading.Lock()
        self._stop = False
        self._closed = False
        self._broken: str | None = None
        self._logged: set[str] = set()
        self._stats_lock = threading.Lock()
        self._counts = dict.fromkeys((
            "puts", "puts_present", "dropped_queue_full", "dropped_unavailable",
            "dropped_write_error", "blocks_written", "batches_committed", "bytes_raw",
            "bytes_stored", "gets", "hits", "misses", "corrupt_deleted", "read_errors",
            "evictions", "map_full_retries", "syncs", "dropped_no_room"), 0)

    def _register_path(self) -> None:
        real = os.path.realpath(self.path)
        with _OPEN_LOCK:
            if real in _OPEN_PATHS:
                raise ConfigError(f"path: {self.path} is already open by another SSDTier in "
                                  "this process; share that instance")
            _OPEN_PATHS.add(real)

    def _unregister_path(self) -> None:
        with _OPEN_LOCK:
            _OPEN_PATHS.discard(os.path.realpath(self.path))

    def _open(self) -> None:
        import lmdb
        existed = (self.path / "data.mdb").exists()
        if not existed and self.path.exists() and not {p.name for p in self.path.iterdir()} <= {
                "lock.mdb", _CLEAN, _BLOCKS}:
            raise ConfigError(f"path: {self.path} is a non-empty directory without an LMDB "
                              "environment; refusing to write into it")
        self.path.mkdir(exist_ok=True)
        if existed and not self._verified():
            return
        try:
            self._env = self._open_env()
        except lmdb.Error as exc:
            if not existed:
                raise ConfigError(f"path: cannot create an LMDB environment in {self.path}: "
                                  f"{exc}") from exc
            self._fail("open", f"cannot open the LMDB environment: {exc}")
            return
        if not self._file_complete():
            return
        try:
            self._check_ours()
            self._open_dbs()
        except ConfigError:
            self._env.close()
            self._env = None
            raise
        except lmdb.Error as exc:
            self._fail("open", f"cannot read the LMDB environment: {exc}")
            return
        self._open_blocks()

    def _open_env(self) -> Any:
        import lmdb
        return lmdb.open(str(self.path), map_size=self.capacity_bytes + self.slack_bytes,
                         subdir=True, max_dbs=8, sync=False, metasync=False,
                         readahead=True, meminit=False, max_spare_txns=4)

    def _verified(self) -> bool:
        """Walk an existing environment in a child process before this one touches it.

        A damaged B-tree (bit rot, a torn write, a crash mid-sync) can make LMDB
        abort() or fault with SIGBUS on the first page it reaches; the child
        takes that risk instead, and a failure disables the tier. This runs at
        every open, clean shutdown or not: damage can happen while closed.
        """
        marker = self.path / _CLEAN
        clean = marker.exists()
        if clean:
            marker.unlink()
        problem = _walk_in_subprocess(self.path)
        if problem is not None:
            when = "" if clean else " after an unclean shutdown"
            self._fail("open", f"the environment does not verify{when} ({problem})")
            return False
        return True

    def _file_complete(self) -> bool:
        """A data file shorter than its last page would fault on access: treat it as corrupt."""
        info = self._env.info()
        need = (info["last_pgno"] + 1) * self._env.stat()["psize"]
        size = (self.path / "data.mdb").stat().st_size
        if size < need:
            self._fail("open", f"data.mdb has {size} bytes but its pages reach {need}: "
                               "truncated or half-written")
            return False
        return True

    def _check_ours(self) -> None:
        """Refuse an LMDB environment that tierkv did not create (nothing is written to it)."""
        import lmdb
        try:
            with self._env.begin() as txn:
                names = list(txn.cursor().iternext(values=False))
        except lmdb.Error:
            return  # unreadable: _open_dbs reports it as corrupt
        if names and b"meta" not in names:
            raise ConfigError(f"path: {self.path} holds an LMDB environment that tierkv did "
                              "not create; refusing to use it")

    def _open_dbs(self) -> None:
        import msgpack
        env = self._env
        self._meta = env.open_db(b"meta")
        self._head = env.open_db(b"head")
        self._lru = env.open_db(b"lru")
        now = time.time()
        with env.begin(write=True) as txn:
            info = txn.get(b"tierkv", db=self._meta)
            if info is None:
                if txn.stat(self._head)["entries"]:
                    raise ConfigError(f"path: {self.path} holds an LMDB environment that "
                                      "tierkv did not create; refusing to use it")
                self._init_meta(txn, now)
            elif _format_of(info) != RECORD_VERSION:
                self._discard_old_format(txn, _format_of(info), now)
            nskey = b"ns:" + self._ns
            if txn.get(nskey, db=self._meta) is None:
                txn.put(nskey, msgpack.packb({
                    "fingerprint": self.fingerprint, "block_nbytes": self.block_nbytes,
                    "compression": self.compression, "created_at": now}), db=self._meta)
        self._env.sync(True)

    def _init_meta(self, txn: Any, now: float) -> None:
        import msgpack
        txn.put(b"tierkv", msgpack.packb({"format": RECORD_VERSION, "created_at": now}),
                db=self._meta)
        txn.put(b"state", _STATE.pack(0, 0), db=self._meta)

    def _discard_old_format(self, txn: Any, found: object, now: float) -> None:
        """Records of another format version cannot be read: drop them (it is a cache)."""
        import lmdb
        log.warning("SSD tier at %s: records of format %r are not readable by format %d; "
                    "discarding %d of them", self.path, found, RECORD_VERSION,
                    txn.stat(self._head)["entries"])
        for name in (b"head", b"lru", b"body"):
            try:
                db = self._env.open_db(name, txn=txn, create=False)
            except lmdb.NotFoundError:
                continue
            txn.drop(db, delete=name == b"body")
        self._init_meta(txn, now)

    def _open_blocks(self) -> None:
        """Open the block file and rebuild its free-space map from the heads."""
        try:
            self._fd = os.open(self.path / _BLOCKS, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._load_extents()
        except OSError as exc:
            self._fail("open", f"cannot open {_BLOCKS}: {exc}")
        except Exception as exc:  # lmdb.Error, or a head LMDB returns malformed
            self._fail("open", f"cannot read the index: {exc!r}")

    def _load_extents(self) -> None:
        """Scan every head: drop records that do not verify or point past the block
        file or into another record's pages; recount the used bytes; free the rest."""
        size = os.fstat(self._fd).st_size
        good: dict[bytes, tuple[int, int, int]] = {}   # nskey -> (page, pages, footprint)
        bad: list[bytes] = []
        with self._env.begin(write=True, buffers=True) as txn:
            for nskey, head in txn.cursor(db=self._head).iternext():
                nskey = bytes(nskey)
                try:
                    hdr = Header.unpack(bytes(head))
                except CorruptRecord:
                    bad.append(nskey)
                    continue
                body_len = hdr.payload_len - hdr.tail_len
                if body_len and hdr.page * PAGE + body_len > size:
                    bad.append(nskey)  # its body was never written in full (a torn file)
                    continue
                good[nskey] = (hdr.page, hdr.pages, record_footprint(len(nskey), hdr.payload_len))
            extents = {(p, n): k for k, (p, n, _) in good.items() if n}
            for extent in ExtentMap.overlapping(extents):
                bad.append(extents[extent])
                del good[extents[extent]]
            for nskey in bad:
                txn.delete(nskey, db=self._head)
            used = sum(fp for _, _, fp in good.values())
            clock = _STATE.unpack(txn.get(b"state", db=self._meta))[1]
            txn.put(b"state", _STATE.pack(used, clock), db=self._meta)
        if bad:
            self._count("corrupt_deleted", len(bad))
            self._log_once("corrupt", "deleted %d records whose header or pages do not verify "
                           "at open", len(bad))
        limit = (self.capacity_bytes + self.slack_bytes) // PAGE
        self._extents = ExtentMap(limit, [(p, n) for p, n, _ in good.values() if n])
        if size > self._extents.high_water * PAGE:
            os.ftruncate(self._fd, self._extents.high_water * PAGE)

    # ================================================================== health

    def _fail(self, kind: str, message: str) -> None:
        """Disable the tier (misses, dropped puts) and log the reason once."""
        if self._broken is None:
            self._broken = message
            log.error("SSD tier at %s disabled: %s", self.path, message)
        with self._cond:
            self._queue.clear()
            self._pending.clear()
            self._queued_bytes = 0
            self._cond.notify_all()

    def _log_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("SSD tier at %s: " + message, self.path, *args)

    def _usable(self) -> bool:
        if os.getpid() != self._pid:
            self._log_once("fork", "used in pid %d but opened in pid %d; a tier must not "
                           "cross fork(), open a new one in the child", os.getpid(), self._pid)
            return False
        return self._broken is None and not self._closed

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self._counts[name] += n

    # ================================================================== puts

    def put(self, key: bytes, data: Any) -> bool:
        """Queue one block for writing; return True if it is stored or will be.

        ``data`` (bytes-like, numpy array or CPU tensor) is copied before this
        returns, so the caller may reuse its buffer. A key already stored or
        queued only counts as an access. Returns False, storing nothing, when
        the queue is full or the tier is unavailable. Never blocks on disk.
        """
        _check_key(key, "key")
        nbytes = _nbytes(data)
        if self.block_nbytes is not None and nbytes != self.block_nbytes:
            raise ValueError(f"data: expected {self.block_nbytes} bytes, got {nbytes}")
        if nbytes == 0 or nbytes > self.capacity_bytes // 2:
            raise ValueError(f"data: a block of {nbytes} bytes does not fit a tier of "
                             f"{self.capacity_bytes} bytes (at most half of it per block)")
        self._count("puts")
        if not self._usable():
            self._count("dropped_unavailable")
            return False
        nskey = self._ns + key
        if nskey in self._pending or self._stored(nskey):
            self._count("puts_present")
            self._touch(nskey)
            return True
        if self._queued_bytes + nbytes > self.queue_capacity_bytes:
            self._count("dropped_queue_full")
            return False
        return self._enqueue(nskey, data if isinstance(data, bytes) else self._copy_in(data))

    def _copy_in(self, data: Any) -> bytearray:
        """A private copy of a mutable block, in a recycled buffer (fresh allocations
        page-fault, which makes the copy several times slower than a memcpy)."""
        from tierkv.cpu_tier import _as_numpy
        arr = _as_numpy(data, "data")
        if not arr.flags.c_contiguous:
            raise ValueError("data: must be C-contiguous")
        with self._cond:
            spare = self._spare.get(arr.nbytes)
            buf = spare.pop() if spare else None
            if buf is not None:
                self._spare_bytes -= len(buf)
        if buf is None:
            buf = bytearray(arr.nbytes)
        np.copyto(np.frombuffer(buf, dtype=np.uint8), arr.reshape(-1).view(np.uint8))
        return buf

    def _recycle(self, raw: bytes | bytearray) -> None:
        """Keep a copy buffer for reuse, up to the queue's capacity in all. Hold ``_cond``."""
        if isinstance(raw, bytearray) and self._spare_bytes + len(raw) <= self.queue_capacity_bytes:
            self._spare.setdefault(len(raw), []).append(raw)
            self._spare_bytes += len(raw)

    def _enqueue(self, nskey: bytes, raw: bytes | bytearray) -> bool:
        with self._cond:
            if self._queued_bytes + len(raw) > self.queue_capacity_bytes:
                self._count("dropped_queue_full")
                self._recycle(raw)
                return False
            if nskey in self._pending:
                self._recycle(raw)
            else:
                self._queue.append((nskey, raw))
                self._pending[nskey] = raw
                self._queued_bytes += len(raw)
                self._cond.notify_all()
        return True

    def _stored(self, nskey: bytes) -> bool:
        import lmdb
        try:
            with self._env.begin(buffers=True) as txn:
                return txn.get(nskey, db=self._head) is not None
        except lmdb.Error:
            return False

    def _touch(self, nskey: bytes) -> None:
        """Record an access; the writer persists it in its next transaction."""
        if len(self._touched) < _MAX_TOUCHED:
            self._touched[nskey] = None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block accepted so far is committed and synced to disk.

        Also persists pending access-recency updates. Returns False on timeout
        or when the tier is unavailable (its queued blocks are then lost).
        """
        if not self._usable():
            return False
        with self._cond:
            self._flush_req += 1
            ticket = self._flush_req
            self._cond.notify_all()
            done = self._cond.wait_for(
                lambda: self._flush_done >= ticket or self._broken is not None, timeout)
        return bool(done) and self._broken is None

    # ================================================================== gets

    def get(self, key: bytes) -> bytes | None:
        """The block stored under ``key``, verified, or None. Safe from any thread."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Verified blocks (or None) for ``keys``, read in one transaction."""
        nskeys = [self._ns + _check_key(k, "keys") for k in keys]
        self._count("gets", len(nskeys))
        out: list[bytes | None] = [None] * len(nskeys)
        if not self._usable():
            self._count("misses", len(nskeys))
            return out
        records = self._read_records(nskeys)
        out = self._map(lambda kr: kr[1] if isinstance(kr[1], bytes) else self._verify(*kr),
                        list(zip(nskeys, records)))
        hits = sum(v is not None for v in out)
        self._count("hits", hits)
        self._count("misses", len(out) - hits)
        return out

    def get_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[bool]:
        """Read the blocks of ``keys`` straight into caller buffers; return hit flags.

        ``outs[i]`` (a writable, C-contiguous numpy array, CPU tensor, bytearray or
        memoryview of the block's size) receives the block of ``keys[i]``. Raw
        records are read from disk into it and verified there, with no
        intermediate copy or allocation. The buffer of a miss may have been
        overwritten (with bytes that did not verify): use only buffers flagged True.
        """
        if len(outs) != len(keys):
            raise ValueError(f"outs: expected {len(keys)} buffers (one per key), got {len(outs)}")
        nskeys = [self._ns + _check_key(k, "keys") for k in keys]
        views = [_writable_view(o, "outs") for o in outs]
        self._count("gets", len(nskeys))
        if not self._usable():
            self._count("misses", len(nskeys))
            return [False] * len(nskeys)
        records = self._read_records(nskeys, views)
        hit = self._map(lambda krv: self._land(*krv), list(zip(nskeys, records, views)))
        nhit = sum(hit)
        self._count("hits", nhit)
        self._count("misses", len(hit) - nhit)
        return hit

    def _land(self, nskey: bytes, rec: Any, view: memoryview) -> bool:
        """Put a record read by :meth:`_read_records` into ``view`` (where a raw one
        already is), verified."""
        if isinstance(rec, bytes):  # pending
            if len(rec) != len(view):
                return False
            view[:] = rec
            return True
        if rec is None or (rec[0] is not None and rec[0].raw_len != len(view)):
            return False
        return self._verify(nskey, rec, view) is not None

    def _read_records(self, nskeys: list[bytes],
                      into: list[memoryview] | None = None) -> list[Any]:
        """Per key: pending raw bytes, ``(header, payload)`` to verify, or None. With
        ``into``, a raw record of the right size is read into ``into[i]``, which then
        stands for the payload."""
        import lmdb
        with self._cond:  # the writer recycles a pending buffer once it is written
            records: list[Any] = [_frozen(self._pending.get(k)) for k in nskeys]
        with self._reading():
            try:
                with self._env.begin(buffers=True) as txn:
                    heads = [None if rec is not None else txn.get(nskey, db=self._head)
                             for nskey, rec in zip(nskeys, records)]
                    heads = [None if h is None else bytes(h) for h in heads]
            except lmdb.Error as exc:
                self._count("read_errors")
                self._log_once("read", "read failed, reporting misses: %s", exc)
                return [r if isinstance(r, bytes) else None for r in records]
            parsed = [None if h is None else _parse_head(h) for h in heads]
            self._prefetch([h for h in parsed if isinstance(h, Header)])
            for i, (head, hdr) in enumerate(zip(heads, parsed)):
                if head is not None:
                    records[i] = (None, head) if hdr is None else self._read_payload(
                        hdr, head, None if into is None else into[i])
        return records

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """Mark a read as running: pages freed by later commits stay unused until it ends."""
        with self._read_lock:
            start = self._commits
            self._readers[start] = self._readers.get(start, 0) + 1
        try:
            yield
        finally:
            with self._read_lock:
                left = self._readers[start] - 1
                if left:
                    self._readers[start] = left
                else:
                    del self._readers[start]

    def _prefetch(self, hdrs: list[Header]) -> None:
        """Have the kernel start reading a batch's bodies at once: the disk serves them in
        parallel and in any order, where one read at a time waits for each in turn."""
        if len(hdrs) < 2:
            return
        runs: list[list[int]] = []
        for page, pages in sorted((h.page, h.pages) for h in hdrs if h.pages):
            if runs and runs[-1][1] >= page:
                runs[-1][1] = max(runs[-1][1], page + pages)
            else:
                runs.append([page, page + pages])
        try:
            for first, end in runs:
                os.posix_fadvise(self._fd, first * PAGE, (end - first) * PAGE,
                                 os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # only a hint

    def _read_payload(self, hdr: Header, head: bytes, into: memoryview | None = None
                      ) -> tuple[Header | None, Any] | None:
        """The payload a verified head points to (not decoded, not verified); None on an
        I/O error. A raw payload of ``len(into)`` bytes is read into ``into``."""
        tail = head[HEADER.size:]
        body_len = hdr.payload_len - hdr.tail_len
        if not body_len:
            return hdr, tail
        in_place = into is not None and hdr.codec == RAW and hdr.raw_len == len(into)
        try:
            if in_place:
                got = os.preadv(self._fd, [into[:body_len]], hdr.page * PAGE)
            else:
                body = os.pread(self._fd, body_len, hdr.page * PAGE)
                got = len(body)
        except OSError as exc:
            self._count("read_errors")
            self._log_once("read", "reading %s failed, reporting misses: %s", _BLOCKS, exc)
            return None
        if got != body_len:
            return (None, head)  # the block file ends inside this body
        if in_place:
            into[body_len:] = tail
            return hdr, into
        return hdr, body + tail if tail else body

    def _verify(self, nskey: bytes, rec: tuple[Header | None, bytes] | None,
                into: memoryview | None = None) -> Any:
        """The decoded block (in ``into`` when given) if it verifies, else None."""
        if rec is None:
            return None
        hdr, payload = rec
        try:
            if hdr is None:
                raise CorruptRecord("header")
            raw = self._codec.decode(hdr.codec, payload, hdr.raw_len, into)
            if checksum(nskey, raw) != hdr.checksum:
                raise CorruptRecord("checksum mismatch")
        except CorruptRecord as exc:
            self._report_corrupt(nskey, str(exc))
            return None
        self._touch(nskey)
        return raw

    def _report_corrupt(self, nskey: bytes, why: str) -> None:
        self._log_once("corrupt", "deleting a record that does not verify (%s); further "
                       "ones are counted in stats()['corrupt_deleted']", why)
        with self._cond:
            if nskey not in self._bad:
                self._bad[nskey] = 1
                self._cond.notify_all()

    def __contains__(self, key: object) -> bool:
        """True if ``key`` is queued or has a stored record (not verified until read)."""
        if not isinstance(key, bytes) or not self._usable():
            return False
        nskey = self._ns + key
        return nskey in self._pending or self._stored(nskey)

    def keys(self) -> Iterator[bytes]:
        """Keys of this fingerprint with a committed record (one read transaction)."""
        import lmdb
        if not self._usable():
            return iter(())
        found: list[bytes] = []
        try:
            with self._env.begin() as txn:
                cur = txn.cursor(db=self._head)
                if cur.set_range(self._ns):
                    for k in cur.iternext(values=False):
                        if not k.startswith(self._ns):
                            break
                        found.append(k[_NS_LEN:])
        except lmdb.Error as exc:
            self._count("read_errors")
            self._log_once("read", "read failed, reporting misses: %s", exc)
        return iter(found)

    # ================================================================== writer

    def _writer_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._has_work, _TOUCH_INTERVAL_S)
                self._cond.wait_for(self._batch_ready, _LINGER_S)  # one commit per batch, not per put
                batch, ticket = self._take_batch()
                touched, self._touched = self._touched, {}
                bad, self._bad = self._bad, {}
                stop = self._stop and not self._queue
            sync = bool(ticket) or stop or self._unsynced >= _SYNC_BYTES or (
                self._unsynced and time.monotonic() - self._last_sync >= _SYNC_INTERVAL_S)
            if self._broken is None and (batch or touched or bad or sync):
                self._write_safely(batch, list(touched), list(bad), sync)
            with self._cond:
                for nskey, raw in batch:
                    self._pending.pop(nskey, None)
                    self._queued_bytes = max(0, self._queued_bytes - len(raw))
                    self._recycle(raw)
                if ticket:
                    self._flush_done = max(self._flush_done, ticket)
                self._cond.notify_all()
            if stop:
                return

    def _batch_ready(self) -> bool:
        """Worth a commit: enough bytes to keep the disk busy while more are being queued
        (writing overlaps the callers' copies), a flush or a stop. Otherwise the writer
        lingers, so that small puts share a commit."""
        return (self._queued_bytes >= min(self.batch_bytes, _EAGER_BYTES) or not self._queue
                or self._stop or self._flush_req > self._flush_done)

    def _has_work(self) -> bool:
        return bool(self._queue or self._bad or self._stop or self._flush_req > self._flush_done)

    def _take_batch(self) -> tuple[list[tuple[bytes, bytes]], int]:
        """Up to ``batch_bytes`` of queued blocks; the flush ticket they complete, if any."""
        batch: list[tuple[bytes, bytes]] = []
        size = 0
        while self._queue and (not batch or size + len(self._queue[0][1]) <= self.batch_bytes):
            item = self._queue.popleft()
            batch.append(item)
            size += len(item[1])
        done = not self._queue and self._flush_req > self._flush_done
        return batch, (self._flush_req if done else 0)

    def _write_safely(self, batch: list[tuple[bytes, bytes]], touched: list[bytes],
                      bad: list[bytes], sync: bool) -> None:
        import lmdb
        try:
            encoded = self._encode(batch)
            if not self._write_with_retries(encoded, touched, bad, sync):
                self._count("dropped_no_room", len(encoded))
        except lmdb.Error as exc:
            self._count("dropped_write_error", len(batch))
            self._fail("write", f"write failed: {exc!r}")
        except OSError as exc:  # the block file: disk full, I/O error
            self._count("dropped_write_error", len(batch))
            self._log_once("pwrite", "writing %s failed, dropping the batch: %s", _BLOCKS, exc)
        except Exception:
            self._count("dropped_write_error", len(batch))
            log.exception("SSD tier at %s: unexpected error in the writer; batch dropped",
                          self.path)

    def _encode(self, batch: list[tuple[bytes, bytes]]) -> list[_Encoded]:
        """Compress and checksum a batch."""
        return self._map(lambda item: _Encoded(item[0], item[1], self._codec), batch)

    def _map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        """``[fn(x) for x in items]``, on several threads when compressed blocks make it
        pay (zstd, numpy and xxhash release the GIL; each thread has its own compressor)."""
        if self.compression == "none" or len(items) < 2 or _CODER_THREADS < 2:
            return [fn(x) for x in items]
        with self._stats_lock:
            if self._coders is None:
                from concurrent.futures import ThreadPoolExecutor
                self._coders = ThreadPoolExecutor(_CODER_THREADS,
                                                  thread_name_prefix="tierkv-ssd-codec")
        return list(self._coders.map(fn, items))

    def _write_with_retries(self, encoded: list[_Encoded], touched: list[bytes],
                            bad: list[bytes], sync: bool) -> bool:
        """Commit one batch, evicting more and retrying when the block file has no
        room for it or the map is full; sync when asked to. False: the batch was dropped."""
        import lmdb
        stored = not (encoded or touched or bad)
        step = max(self.capacity_bytes // 8, sum(e.footprint for e in encoded))
        for attempt in range(_MAX_ATTEMPTS):
            if stored:
                break
            extra = max(0, attempt - 1) * step  # first retry: only the synced evictions
            try:
                stored = self._commit(encoded, touched, bad, extra)
                if not stored:  # evictions committed: make them durable so their pages free up
                    touched, bad = [], []
                    self._sync()
            except lmdb.MapFullError:
                self._count("map_full_retries")
                self._log_once("mapfull", "the map is full (fragmented free pages); evicting "
                               "more and retrying")
                self._make_room(max(step, extra))
        if self._unsynced and (sync or not stored):
            self._sync()
        return stored

    def _sync(self) -> None:
        """Make every commit so far durable (block file first), then reuse the pages
        they freed where no read could still see them."""
        os.fdatasync(self._fd)
        self._env.sync(True)
        self._count("syncs")
        self._unsynced = 0
        self._last_sync = time.monotonic()
        self._synced_commits = self._commits
        self._release()

    def _release(self) -> None:
        with self._read_lock:
            oldest = min(self._readers, default=self._commits)
        ready = min(oldest, self._synced_commits)
        waiting = []
        for commit, extents in self._quarantine:
            if commit <= ready:
                for page, pages in extents:
                    self._extents.free(page, pages)
            else:
                waiting.append((commit, extents))
        self._quarantine = waiting

    def _make_room(self, extra: int) -> None:
        """Evict ``extra`` bytes beyond the capacity and commit twice, so that the
        freed LMDB pages become reusable (LMDB reuses pages two commits after freeing)."""
        self._commit([], [], [], extra=extra)
        self._commit([], [], [])

    def _commit(self, encoded: list[_Encoded], touched: list[bytes], bad: list[bytes],
                extra: int = 0) -> bool:
        """One write transaction: drop bad records, apply accesses, evict, write the new
        bodies and insert their heads. False if the block file had no room for them
        (everything else is committed)."""
        freed: list[tuple[int, int]] = []
        taken: list[tuple[int, int]] = []
        try:
            with self._env.begin(write=True, buffers=True) as txn:
                used, clock = _STATE.unpack(txn.get(b"state", db=self._meta))
                for nskey in bad:
                    fp = self._delete(txn, nskey, freed)
                    if fp:  # a second report of the same record finds it gone
                        used -= fp
                        self._count("corrupt_deleted")
                for nskey in touched:
                    clock = self._retouch(txn, nskey, clock)
                new = [e for e in encoded if txn.get(e.nskey, db=self._head) is None]
                need = sum(e.footprint for e in new) + extra
                used = self._evict(txn, max(used, 0), self.capacity_bytes - need, freed)
                placed = self._place(new, taken)
                if placed:
                    for e in new:
                        _pwrite_all(self._fd, e.body, e.header.page * PAGE)
                        clock += 1
                        txn.put(e.nskey, e.head(clock), db=self._head)
                        txn.put(_CLOCK.pack(clock), e.nskey, db=self._lru)
                        used += e.footprint
                    self._unsynced += sum(len(e.body) for e in new)
                txn.put(b"state", _STATE.pack(max(used, 0), clock), db=self._meta)
        except BaseException:
            for page, pages in taken:
                self._extents.free(page, pages)
            raise
        self._commits += 1
        self._unsynced += 1
        if freed:
            self._quarantine.append((self._commits, freed))
        if placed:
            self._account(new)
        return placed

    def _place(self, new: list[_Encoded], taken: list[tuple[int, int]]) -> bool:
        """Give every new record's body pages in the block file (all or none)."""
        for e in new:
            if not e.pages:
                continue
            page = self._extents.allocate(e.pages)
            if page is None:
                for extent in taken:
                    self._extents.free(*extent)
                taken.clear()
                return False
            taken.append((page, e.pages))
            e.header = e.header.at_page(page)
        return True

    def _account(self, new: list[_Encoded]) -> None:
        with self._stats_lock:
            c = self._counts
            c["blocks_written"] += len(new)
            c["batches_committed"] += 1
            c["bytes_raw"] += sum(e.raw_len for e in new)
            c["bytes_stored"] += sum(e.header.payload_len for e in new)

    def _evict(self, txn: Any, used: int, target: int, freed: list[tuple[int, int]]) -> int:
        """Delete least recently used records until ``used <= target``; return ``used``."""
        cur = txn.cursor(db=self._lru)
        while used > target and cur.first():
            nskey = bytes(cur.value())
            cur.delete()
            used -= self._delete(txn, nskey, freed, lru=False)
            self._count("evictions")
        return used

    def _delete(self, txn: Any, nskey: bytes, freed: list[tuple[int, int]],
                lru: bool = True) -> int:
        """Remove one record, adding its body pages to ``freed``; return its footprint
        (0 if absent). A head that does not verify frees no pages (its pages are
        recovered at the next open, which rebuilds the free-space map)."""
        head = txn.get(nskey, db=self._head)
        if head is None:
            return 0
        head = bytes(head)
        txn.delete(nskey, db=self._head)
        try:
            hdr = Header.unpack(head)
        except CorruptRecord:
            return len(head)
        if lru and txn.get(_CLOCK.pack(hdr.clock), db=self._lru) == nskey:
            txn.delete(_CLOCK.pack(hdr.clock), db=self._lru)
        if hdr.pages:
            freed.append((hdr.page, hdr.pages))
        return record_footprint(len(nskey), hdr.payload_len)

    def _retouch(self, txn: Any, nskey: bytes, clock: int) -> int:
        """Move one record to the most recent end of the LRU order."""
        head = txn.get(nskey, db=self._head)
        if head is None:
            return clock
        head = bytes(head)
        try:
            hdr = Header.unpack(head)
        except CorruptRecord:
            return clock  # a read will find it and have it deleted
        if txn.get(_CLOCK.pack(hdr.clock), db=self._lru) == nskey:
            txn.delete(_CLOCK.pack(hdr.clock), db=self._lru)
        clock += 1
        txn.put(nskey, hdr.with_clock(clock).pack() + head[HEADER.size:], db=self._head)
        txn.put(_CLOCK.pack(clock), nskey, db=self._lru)
        return clock

    # ================================================================== lifecycle

    def stats(self) -> dict[str, Any]:
        """Counters since open, plus the environment's current size."""
        with self._stats_lock:
            out: dict[str, Any] = dict(self._counts)
        out["compression_ratio"] = (out["bytes_raw"] / out["bytes_stored"]
                                    if out["bytes_stored"] else 1.0)
        out["capacity_bytes"] = self.capacity_bytes
        out["queued_bytes"] = self._queued_bytes
        out["current_bytes"] = self._used_bytes()
        out["index_file_bytes"] = _size(self.path / "data.mdb")
        out["block_file_bytes"] = _size(self.path / _BLOCKS)
        out["file_bytes"] = out["index_file_bytes"] + out["block_file_bytes"]
        out["available"] = self._broken is None and not self._closed
        return out

    def _used_bytes(self) -> int:
        import lmdb
        if not self._usable():
            return 0
        try:
            with self._env.begin() as txn:
                return _STATE.unpack(txn.get(b"state", db=self._meta))[0]
        except (lmdb.Error, TypeError, struct.error):
            return 0

    def close(self) -> None:
        """Flush, stop the writer and close the environment. Idempotent."""
        if self._closed:
            return
        if os.getpid() != self._pid:
            self._closed = True  # the parent owns the environment; leave it alone
            return
        if self._broken is None:
            self.flush()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._writer.join()
        if self._coders is not None:
            self._coders.shutdown()
        self._closed = True
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._env is not None:
            self._env.close()
            if self._broken is None:
                try:
                    (self.path / _CLEAN).touch()
                except OSError as e:  # the directory went away or is read-only: next open re-verifies
                    self._log_once("close", "cannot write the clean marker: %s", e)
        self._unregister_path()

    def __enter__(self) -> "SSDTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"SSDTier({str(self.path)!r}, capacity_bytes={self.capacity_bytes}, "
                f"compression={self.compression!r})")


# ====================================================================== argument checks

def _format_of(info: Any) -> object:
    import msgpack
    try:
        return msgpack.unpackb(bytes(info)).get("format")
    except Exception:  # a damaged meta record: treated as an unknown format
        return None


def _check_key(key: object, what: str) -> bytes:
    if not isinstance(key, bytes):
        raise ValueError(f"{what}: expected bytes (a block hash), got {type(key).__name__}")
    return key


def _check_int(value: object, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{what}: expected an integer >= {minimum}, got {value!r}")
    return value


def _check_block_nbytes(value: int | None) -> int | None:
    return None if value is None else _check_int(value, "block_nbytes", 1)


def _check_capacity(value: object, block_nbytes: int | None) -> int:
    cap = _check_int(value, "capacity_bytes", 0)
    floor = max(2 * (block_nbytes or 0), 1024**2)
    if cap < floor:
        raise ConfigError(f"capacity_bytes: {cap} is too small; the SSD tier needs at least "
                          f"{floor} bytes (1 MiB and two blocks)")
    return cap


def _check_fingerprint(value: object) -> bytes:
    if isinstance(value, str):
        value = value.encode()
    if not isinstance(value, bytes) or not value:
        raise ConfigError(f"fingerprint: expected a non-empty str or bytes, got {value!r}")
    return value


def _check_path(value: object) -> Path:
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise ConfigError(f"path: expected a directory path, got {value!r}")
    path = Path(os.path.expanduser(os.fspath(value))).absolute()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"path: {path} exists and is not a directory")
    if not path.exists() and not path.parent.is_dir():
        raise ConfigError(f"path: the parent directory {path.parent} does not exist "
                          "(create it first; tierkv does not create mount points)")
    target = path if path.exists() else path.parent
    if not os.access(target, os.W_OK | os.X_OK):
        raise ConfigError(f"path: {target} is not writable")
    for name in ("data.mdb", _BLOCKS):
        if (path / name).exists() and not os.access(path / name, os.R_OK | os.W_OK):
            raise ConfigError(f"path: {path / name} is not readable and writable")
    return path


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _nbytes(data: Any) -> int:
    if isinstance(data, (bytes, bytearray)):
        return len(data)
    if isinstance(data, memoryview):
        return data.nbytes
    nbytes = getattr(data, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if type(data).__module__.startswith("torch"):
        return data.numel() * data.element_size()
    raise ValueError(f"data: expected a torch tensor, numpy array or bytes, "
                     f"got {type(data).__name__}")


def _parse_head(head: bytes) -> Header | None:
    try:
        return Header.unpack(head)
    except CorruptRecord:
        return None


def _writable_view(buf: Any, what: str) -> memoryview:
    """A flat writable byte view of ``buf`` (numpy array, CPU tensor, bytearray, memoryview)."""
    from tierkv.cpu_tier import _as_numpy
    if isinstance(buf, bytes):
        raise ValueError(f"{what}: bytes are read-only; pass a bytearray or an array")
    arr = _as_numpy(buf, what)
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        raise ValueError(f"{what}: every buffer must be writable and C-contiguous")
    return memoryview(arr.reshape(-1).view(np.uint8))


def _frozen(raw: bytes | bytearray | None) -> bytes | None:
    return bytes(raw) if isinstance(raw, bytearray) else raw
