"""The SSD tier's front: :class:`SSDTier`, the parts put together behind one object.

The front checks arguments, adds the namespace prefix to keys, counts, and
routes each call to its part: puts and discards to the write queue, reads to
the reader, ``keys()`` and membership to the index, lost keys to their log.
It owns the parts' lifetime: an :class:`~kvstrata.tiers.ssd.recovery.Opening`
opens the files, then the writer thread starts; ``close()`` flushes, stops the
writer, closes the files and saves the clean-close snapshot
(:mod:`~kvstrata.tiers.ssd.snapshot`) that lets the next open skip recovery.

After an unclean shutdown, an index larger than ``recover_inline_bytes``
recovers in the background (:class:`~kvstrata.tiers.ssd.recovery.Background`):
the constructor returns at once, and until the recovered files are handed
over the tier is *recovering*: reads miss, ``keys()`` lists nothing,
membership is False, accesses are ignored, while puts and discards queue (up
to the queue's capacity) and ``flush`` waits for them to be written once it is
done. :meth:`SSDTier.wait_ready` waits for that; ``stats()["recovering"]``
says whether it is still going on. Nothing is served before the walk has
vouched for the environment; a recovery that fails disables the tier (queued
puts are reported lost).

One process, one tier per directory: the tier holds the directory's lock
(:mod:`~kvstrata.tiers.ssd.owner`) from before recovery until ``close()``. The
directory is 0700 and its files 0600. :func:`read_keys` lists the keys of a
directory another process owns, without opening it.

Threads: ``get``, ``get_many``, ``get_into``, ``__contains__``, ``keys``,
``put``, ``discard_many``, ``touch_many``, ``take_lost``, ``stats`` and
``wait_ready`` may be called from any thread, also while ``close()`` runs
(they then miss, or drop); ``flush`` and ``close`` from the owner. The front's
mutable state: the failure count seen by the last flush (owner only), and the
open parts (files, reader, writer), set once, by the constructor or by the
recovery thread, files last (a thread that sees the files sees the others);
``close`` stops the recovery thread before it reads them (puts it queued meanwhile
are then reported lost). Each part documents
its own locks. Never use a tier across ``fork()``: a child process sees it as
disabled and must open its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from kvstrata.tiers.buffers import as_numpy, nbytes, writable_view
from kvstrata.tiers.ssd.arguments import (MAX_KEY_LEN, check_block_nbytes, check_capacity, check_fingerprint,
                                         check_int, check_key, check_path, file_size)
from kvstrata.tiers.ssd.coders import Coders
from kvstrata.tiers.ssd.health import Health
from kvstrata.tiers.ssd.index import IndexFailure
from kvstrata.tiers.ssd.lost import LostKeys
from kvstrata.tiers.ssd.owner import Owner
from kvstrata.tiers.ssd.pagefile import BLOCKS
from kvstrata.tiers.ssd.reader import Reader
from kvstrata.tiers.ssd.beside import read_beside
from kvstrata.tiers.ssd.reclaim import Reclaim
from kvstrata.tiers.ssd.record import NS_LEN, Codec, namespace_of
from kvstrata.tiers.ssd.directory import prepare_directory
from kvstrata.tiers.ssd.recovery import Background, Files, Opening
from kvstrata.tiers.ssd.writequeue import WriteQueue
from kvstrata.tiers.ssd.writer import Writer

__all__ = ["SSDTier", "read_keys", "read_tags", "check_path", "MAX_KEY_LEN", "MAX_TAG_LEN"]

MAX_TAG_LEN = 4096               # longest tag kept beside a record
RECOVER_INLINE_BYTES = 16 * 1024**2   # larger indexes recover in the background

log = logging.getLogger("kvstrata.tiers.ssd")


class SSDTier:
    """Blocks on SSD: a page file indexed by LMDB, bounded by bytes, evicted LRU.

    Parameters: ``path`` (a directory whose parent exists; created if
    missing; must be empty or hold a kvstrata environment; owned by this
    instance until ``close()``: a second opener gets a ``ConfigError`` naming
    the holder's PID), ``capacity_bytes``
    (hard bound on the bytes of stored records, page rounding included, see
    :func:`~kvstrata.tiers.ssd.record.capacity_blocks`), ``fingerprint`` (str or
    bytes identifying model + KV layout + dtype + block size), ``compression``
    (``"auto"``, ``"zstd"`` or ``"none"``), ``level`` (zstd level),
    ``queue_capacity_bytes`` (puts beyond this much unwritten data are
    dropped), ``block_nbytes`` (when given, every block must have exactly this
    size), ``recover_inline_bytes`` (after an unclean shutdown, an index
    (``data.mdb``) up to this size is recovered before the constructor
    returns, a larger one in the background; 0: always in the background).

    Each file stays below ``capacity_bytes + slack_bytes``: the page file's
    free-space map never hands out pages past that, and it is the LMDB map
    size. The slack holds pages freed but not yet reusable (see
    :mod:`~kvstrata.tiers.ssd.reclaim`) and fragmentation; the index itself is
    small (about 200 bytes per record).
    """

    def __init__(self, path: str | os.PathLike[str], *, capacity_bytes: int,
                 fingerprint: str | bytes, compression: str = "auto", level: int = 1,
                 queue_capacity_bytes: int = 256 * 1024**2,
                 block_nbytes: int | None = None,
                 recover_inline_bytes: int = RECOVER_INLINE_BYTES) -> None:
        self.path = check_path(path)
        self.block_nbytes = check_block_nbytes(block_nbytes)
        self.capacity_bytes = check_capacity(capacity_bytes, self.block_nbytes)
        self.fingerprint = check_fingerprint(fingerprint)
        self.queue_capacity_bytes = check_int(queue_capacity_bytes, "queue_capacity_bytes", 1)
        self.recover_inline_bytes = check_int(recover_inline_bytes, "recover_inline_bytes", 0)
        self._codec = Codec(compression, level)
        self.compression = compression
        self.batch_bytes = min(16 * 1024**2, max(self.capacity_bytes // 16, 256 * 1024))
        self.slack_bytes = self.capacity_bytes // 16 + 4 * self.batch_bytes + 4 * 1024**2
        self._ns = namespace_of(self.fingerprint)
        self._health = Health(self.path)
        self._lost = LostKeys(self._ns)
        self._queue = WriteQueue(self.queue_capacity_bytes, self.batch_bytes, self._lost)
        self._reclaim = Reclaim()
        self._coders = Coders(parallel=compression != "none")
        self._files: Files | None = None
        self._reader: Reader | None = None
        self._writer: Writer | None = None
        self._background: Background | None = None
        self._flushed_failures = 0
        prepare_directory(self.path)
        self._owner = Owner(self.path)
        try:
            self._open(Opening(
                self.path, map_size=self.capacity_bytes + self.slack_bytes, namespace=self._ns,
                about={"fingerprint": self.fingerprint, "block_nbytes": self.block_nbytes,
                       "compression": compression},
                health=self._health, lost=self._lost))
        except BaseException:
            if self._files is not None:
                self._files.close()
            self._owner.release()
            raise

    def _open(self, opening: Opening) -> None:
        """Open the files now, or have them recovered in the background."""
        if not opening.begin():
            return
        if opening.needs_recovery and opening.index_bytes() > self.recover_inline_bytes:
            log.warning("SSD tier at %s: %s; verifying its %.0f MiB index in the background "
                        "(reads miss until then)", self.path, opening.why,
                        opening.index_bytes() / 1024**2)
            self._background = Background(opening, self._recovered,
                                          name=f"kvstrata-ssd-recovery:{self.path.name}")
            self._background.start()
            return
        files = opening.finish()
        if files is not None:
            self._start(files)

    def _recovered(self, files: Files | None) -> None:
        """On the recovery thread: serve the recovered files, or drop what was queued."""
        if files is not None:
            self._start(files)
        elif self._background is not None and not self._background.cancel.event.is_set():
            self._queue.fail()

    def _start(self, files: Files) -> None:
        self._reader = Reader(files=files, reclaim=self._reclaim, queue=self._queue,
                              codec=self._codec, coders=self._coders, health=self._health)
        self._writer = Writer(files=files, reclaim=self._reclaim, queue=self._queue,
                              codec=self._codec, coders=self._coders, health=self._health,
                              capacity_bytes=self.capacity_bytes,
                              name=f"kvstrata-ssd-writer:{self.path.name}")
        self._writer.start()
        self._files = files  # last: whoever sees the files sees the reader and the writer

    def recovering(self) -> bool:
        """Whether a background recovery is still verifying the records (until it is over,
        reads miss and :meth:`keys` lists nothing)."""
        return self._files is None and self._background is not None and self._background.running()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until a background recovery is over; True if the tier then serves its
        records (False: still recovering after ``timeout``, or unavailable)."""
        background = self._background
        if background is not None and not background.join(timeout):
            return False
        return self._files is not None and self._health.usable()

    @contextlib.contextmanager
    def _using(self) -> Iterator[Files | None]:
        """The open files, or None when the tier is unusable (disabled, closed, forked);
        ``close()`` waits until the block exits before it closes them."""
        with self._health.using() as ok:
            yield self._files if ok else None

    # ================================================================== writes

    def put(self, key: bytes, data: Any, tag: bytes | None = None) -> bool:
        """Queue one block for writing; return True if it is stored or will be.

        ``tag``: at most :data:`MAX_TAG_LEN` bytes kept beside the record, written and
        deleted with it, not verified (what the caller needs to describe the block after
        a restart, see :meth:`tags`); not counted against the capacity.

        ``data`` (bytes-like, numpy array or CPU tensor) is copied before this
        returns, so the caller may reuse its buffer. A key already stored or
        queued only counts as an access (a stored one is found by the writer, which
        keeps the stored block). Returns False, storing nothing, when the queue is
        full or the tier is unavailable. Never blocks on disk.
        Raises ``ValueError`` for a key that is not bytes or longer than
        :data:`MAX_KEY_LEN`, and for data of the wrong size.
        """
        check_key(key, "key")
        if tag is not None and (not isinstance(tag, bytes) or len(tag) > MAX_TAG_LEN):
            raise ValueError(f"tag: expected bytes of at most {MAX_TAG_LEN}, got "
                             f"{type(tag).__name__} of {len(tag) if isinstance(tag, bytes) else '?'}")
        size = nbytes(data)
        if self.block_nbytes is not None and size != self.block_nbytes:
            raise ValueError(f"data: expected {self.block_nbytes} bytes, got {size}")
        if size == 0 or size > self.capacity_bytes // 2:
            raise ValueError(f"data: a block of {size} bytes does not fit a tier of "
                             f"{self.capacity_bytes} bytes (at most half of it per block)")
        health, queue = self._health, self._queue
        health.count("puts")
        if not health.usable():  # a put racing close() is refused by the stopped queue
            health.count("dropped_unavailable")
            return False
        nskey = self._ns + key
        if queue.has_put(nskey):  # a stored key is found by the writer: an access too
            health.count("puts_present")
            queue.touch(nskey)
        elif not queue.put(nskey, self._owned(data), tag):
            health.count("dropped_queue_full")
            return False
        return True

    @staticmethod
    def _owned(data: Any) -> bytes | np.ndarray:
        """``data`` itself if immutable, else as an array for the queue to copy."""
        if isinstance(data, bytes):
            return data
        arr = as_numpy(data, "data")
        if not arr.flags.c_contiguous:
            raise ValueError("data: must be C-contiguous")
        return arr

    def _present(self, files: Files, nskey: bytes) -> bool:
        return self._queue.has_put(nskey) or (
            not self._queue.discarding(nskey) and files.index.has(nskey))

    def discard_many(self, keys: Iterable[bytes]) -> None:
        """Delete the records of ``keys`` (absent ones are ignored), asynchronously.

        Queued puts of these keys are cancelled; stored records are deleted by the
        writer's next transaction (committed and synced when a later :meth:`flush`
        returns), and their pages are reused under the same rules as evicted ones.
        From now on they are absent to ``get``, ``in`` and :meth:`keys`, and they are
        never reported by :meth:`take_lost`. Never blocks on disk, never raises for I/O.
        """
        nskeys = [self._ns + check_key(k, "keys") for k in keys]
        if nskeys and self._health.usable():
            self._queue.discard(nskeys)

    def touch_many(self, keys: Iterable[bytes]) -> None:
        """Record an access to each key (absent ones are ignored), in order, so the last
        is the most recently used; persisted with the writer's next transaction."""
        nskeys = [self._ns + check_key(k, "keys") for k in keys]
        with self._using() as files:
            for nskey in nskeys if files is not None else ():
                if self._present(files, nskey):
                    self._queue.touch(nskey)

    def take_lost(self) -> list[bytes]:
        """Keys of this fingerprint the tier dropped on its own since the last call.

        Oldest first: evicted by the capacity LRU, deleted because they did not verify
        (at a read or at open), or accepted by :meth:`put` but then dropped (no room,
        a write error, the tier disabled). Keys removed by :meth:`discard_many`, puts
        that returned False and keys put again since they were lost are not reported.
        At most a million unread keys are kept; older ones are dropped and counted in
        ``stats()["lost_overflow"]``. Reports live in memory: take them until the
        instance is gone (``close()`` adds what it could not write, such as the puts
        queued while a recovery it cancelled was running); a new instance starts with
        none (seed from :meth:`keys`).
        Safe from any thread.
        """
        return self._lost.take()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block accepted and every discard asked for so far is committed
        and synced to disk.

        Also persists pending access-recency updates. Returns False on timeout,
        when the tier is unavailable (its queued blocks are then lost), and when
        anything accepted since the previous flush was dropped or a sync failed
        (a full disk, an I/O error: ``stats()["last_error"]`` says what, and
        the tier goes on trying, so a later flush is True once the disk has
        room again).
        """
        if not self._health.usable():
            return False
        done = self._queue.flush(timeout) and self._health.broken is None
        failures, self._flushed_failures = self._flushed_failures, self._health.failures
        return done and failures == self._health.failures

    # ================================================================== reads

    def get(self, key: bytes) -> bytes | None:
        """The block stored under ``key``, verified, or None. Safe from any thread."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Verified blocks (or None) for ``keys``, read in one transaction."""
        nskeys = [self._ns + check_key(k, "keys") for k in keys]
        with self._using() as files:
            reader = self._reader if files is not None else None
            out = [None] * len(nskeys) if reader is None else reader.get_many(nskeys)
        self._count_reads(len(out), sum(v is not None for v in out))
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
        nskeys = [self._ns + check_key(k, "keys") for k in keys]
        views = [writable_view(o, "outs") for o in outs]
        with self._using() as files:
            reader = self._reader if files is not None else None
            hit = [False] * len(nskeys) if reader is None else reader.get_into(nskeys, views)
        self._count_reads(len(hit), sum(hit))
        return hit

    def _count_reads(self, n: int, hits: int) -> None:
        self._health.add({"gets": n, "hits": hits, "misses": n - hits})

    def __contains__(self, key: object) -> bool:
        """True if ``key`` is queued or has a stored record (not verified until read)."""
        if not isinstance(key, bytes) or len(key) > MAX_KEY_LEN:
            return False
        with self._using() as files:
            return files is not None and self._present(files, self._ns + key)

    def keys(self) -> Iterator[bytes]:
        """Keys of this fingerprint with a committed record, least recently used first
        (one read transaction)."""
        discarding = self._queue.discarding
        with self._using() as files:
            if files is None:
                return iter(())
            try:
                with self._queue.cond:  # a deletion is committed before this read or after the check
                    nskeys = files.index.keys_lru(self._ns)
                    if not self._queue.discards_pending():
                        return iter([k[NS_LEN:] for k in nskeys])
                    return iter([k[NS_LEN:] for k in nskeys if not discarding(k)])
            except IndexFailure as exc:
                self._health.count("read_errors")
                self._health.log_once("read", "read failed, reporting misses: %s", exc)
                return iter(())

    def tags(self) -> dict[bytes, bytes]:
        """The tags of this fingerprint's committed records (see :meth:`put`); empty when
        the index cannot be read."""
        with self._using() as files:
            if files is None:
                return {}
            try:
                nskeys, tags = files.index.tags(self._ns)
            except IndexFailure as exc:
                self._health.count("read_errors")
                self._health.log_once("read", "read failed, reporting misses: %s", exc)
                return {}
        return {k[NS_LEN:]: t for k, t in zip(nskeys, tags)}

    # ================================================================== lifecycle

    def counts(self) -> dict[str, int]:
        """The counters since open (no file or index access: cheap enough for every step)."""
        return self._health.snapshot()

    def stats(self) -> dict[str, Any]:
        """Counters since open, plus the environment's current size."""
        out: dict[str, Any] = self._health.snapshot()
        out["lost_overflow"] = self._lost.overflow
        out["compression_ratio"] = (out["bytes_raw"] / out["bytes_stored"]
                                    if out["bytes_stored"] else 1.0)
        out["capacity_bytes"] = self.capacity_bytes
        out["queued_bytes"] = self._queue.queued_bytes
        with self._using() as files:
            out["current_bytes"] = 0 if files is None else files.index.used_bytes()
        out["index_file_bytes"] = file_size(self.path / "data.mdb")
        out["block_file_bytes"] = file_size(self.path / BLOCKS)
        out["file_bytes"] = out["index_file_bytes"] + out["block_file_bytes"]
        out["available"] = self._health.broken is None and not self._health.closed
        out["recovering"] = self.recovering()
        out["disabled_reason"] = self._health.broken
        out["last_error"] = self._health.last_error
        return out

    @property
    def closed(self) -> bool:
        """Has :meth:`close` been called?"""
        return self._health.closed

    def close(self) -> None:
        """Flush, stop the writer, close the files and save the clean-close snapshot (a
        recovery still running is cancelled: what it had not verified stays for the next
        open to recover). Idempotent."""
        health = self._health
        if health.closed:
            return
        if os.getpid() != health.pid:
            health.closed = True  # the parent owns the environment; leave it alone
            return
        if self._background is not None:
            self._background.stop()
            if self._writer is None:  # cancelled before it served: what was queued is lost
                self._queue.fail()
        if health.broken is None and self._writer is not None:
            self.flush()
        health.quiesce()  # from here every call misses or drops; none is still using the files
        self._queue.stop()  # the writer drains what was accepted before, then stops
        if self._writer is not None:
            self._writer.join()
        self._coders.close()
        if self._files is not None:
            self._close_files(self._files)
        self._owner.release()

    def _close_files(self, files: Files) -> None:
        """Close the files; save the snapshot when they are exactly as the map says."""
        settled = self._health.broken is None and self._writer is not None and \
            self._writer.settled()
        snapshot = files.snapshot() if settled else None
        files.close()
        if snapshot is None:
            return
        try:
            snapshot.save(self.path)
        except OSError as exc:  # the directory went away or is read-only: the next open recovers
            self._health.log_once("close", "cannot save the clean-close snapshot: %s", exc)

    def __enter__(self) -> "SSDTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"SSDTier({str(self.path)!r}, capacity_bytes={self.capacity_bytes}, "
                f"compression={self.compression!r})")


# ====================================================================== argument checks

def read_keys(path: str | os.PathLike[str], fingerprint: str | bytes, *,
              timeout: float = 600.0) -> list[bytes]:
    """The keys of ``fingerprint`` in the tier at ``path``, least recently used first,
    read without owning the directory: beside the process that has the tier open, as
    one more LMDB reader, in a child process (a damaged environment can fault the
    process that maps it), which sends them back in one buffer. Empty when there is no
    tier there. Never writes a file: beside an owner it takes a reader slot in the
    owner's ``lock.mdb`` (shared memory); where there is none it opens without one.
    Raises ``OSError`` when the keys cannot be read, or what the directory holds is not a
    kvstrata tier (one of the previous name, another program's environment), unopened."""
    return read_beside(path, namespace_of(check_fingerprint(fingerprint)), "keys", timeout)


def read_tags(path: str | os.PathLike[str], fingerprint: str | bytes, *,
              timeout: float = 600.0) -> dict[bytes, bytes]:
    """:meth:`SSDTier.tags` of the tier at ``path``, read beside its owner as
    :func:`read_keys` reads keys. Raises ``OSError`` when they cannot be read."""
    return read_beside(path, namespace_of(check_fingerprint(fingerprint)), "tags", timeout)
