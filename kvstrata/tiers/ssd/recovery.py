"""Opening the SSD tier's files, and repairing what a crash or damage left behind.

The directory was identified and made owner-only first
(:func:`~kvstrata.tiers.ssd.directory.prepare_directory`: what is not a tier's
is refused untouched), and the tier took the directory's lock
(:mod:`~kvstrata.tiers.ssd.owner`). An :class:`Opening` goes on, before
anything touches an existing environment:

1. LMDB's lock file gets its disk blocks up front: LMDB writes it through a
   memory map, where a full disk is a SIGBUS instead of an error. No room
   for them disables the tier.
2. The clean-close snapshot (:mod:`~kvstrata.tiers.ssd.snapshot`) is read and
   removed. If it verifies and ``data.mdb`` is byte for byte what it
   describes, the environment needs no walk and the page file's free-space map
   is the one saved: the open takes time in proportion to the index's bytes
   (one hash), not to its records.
3. Otherwise (an unclean shutdown, or damage since the clean close) the tier
   *recovers*: the environment is walked in a child process
   (:mod:`~kvstrata.tiers.ssd.walk`), which also surveys every head
   (:mod:`~kvstrata.tiers.ssd.survey`) and writes what it walked as a fresh
   environment. A damaged B-tree can make LMDB abort() or fault with SIGBUS
   on the first page it reaches, and the child takes that risk; a walk that
   fails disables the tier. The rebuilt environment replaces ``data.mdb``
   (atomically, with a new lock file): this process maps only an environment
   the snapshot vouched for byte for byte, or one written afresh from what
   the walk read, never pages (LMDB's free list) no check has read.
4. ``data.mdb`` must be as long as its last page, or access would fault.
5. An LMDB environment that kvstrata did not create is refused, untouched.
6. Records of another record format are discarded (logged): they cannot be read.
7. After a recovery, the survey is applied: records whose head does not
   verify, whose body lies past the end of ``blocks.dat`` or on pages of
   another record are deleted (counted, reported lost); the used bytes are
   recounted; pages no head points to (a crash between the page write and the
   commit) are free again. Either way the page file is cut after its last used
   page.

Small environments (up to the tier's ``recover_inline_bytes``) recover before
the tier's constructor returns. Larger ones recover on a thread of their own
(:class:`Background`): the tier serves misses, and queues puts and discards,
until the walked and surveyed index is in place; nothing is read from the
environment before the walk vouched for it. A failure in any step disables the
tier (logged once with the path); it never raises, except ``ConfigError`` for a
directory that is not ours when that is found before the constructor returns.

Threads: an :class:`Opening` runs on one thread (the constructor's, or the
background one); nothing here is shared until the files are handed over,
except :meth:`Background.stop`, which the owner calls from its own thread.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from kvstrata.errors import ConfigError
from kvstrata.tiers.ssd.arguments import file_size
from kvstrata.tiers.ssd.extents import ExtentMap
from kvstrata.tiers.ssd.index import Index, IndexFailure, WriteTxn
from kvstrata.tiers.ssd.pagefile import BLOCKS, PageFile
from kvstrata.tiers.ssd.directory import FILE_MODE, LMDB_LOCK
from kvstrata.tiers.ssd.private import open_private
from kvstrata.tiers.ssd.record import PAGE, RECORD_VERSION
from kvstrata.tiers.ssd.snapshot import CLEAN, UNCLEAN, Snapshot, take
from kvstrata.tiers.ssd.survey import Survey, survey
from kvstrata.tiers.ssd.walk import REBUILT, Cancel, Cancelled, Damaged, Foreign, _format_of, walk

if TYPE_CHECKING:
    from kvstrata.tiers.ssd.health import Health
    from kvstrata.tiers.ssd.lost import LostKeys

__all__ = ["Files", "Opening", "Background", "open_files", "CLEAN"]

log = logging.getLogger("kvstrata.tiers.ssd")

LMDB_LOCK_BYTES = 8192   # what LMDB sizes its lock file to (126 reader slots); more is fine


@dataclass
class Files:
    """An open tier's files: the index, the page file, the page file's free-space map and
    the records per namespace (both owned by the writer thread once it starts)."""

    index: Index
    pages: PageFile
    space: ExtentMap
    counts: dict[bytes, int] = field(default_factory=dict)

    def add_counts(self, delta: dict[bytes, int]) -> None:
        for ns, n in delta.items():
            self.counts[ns] = self.counts.get(ns, 0) + n

    def snapshot(self) -> Snapshot:
        """What a clean close saves (call once the writer stopped)."""
        return Snapshot.of(self.space, {ns: n for ns, n in self.counts.items() if n > 0})

    def close(self) -> None:
        self.pages.close()
        self.index.close()


def open_files(path: Path, *, map_size: int, namespace: bytes, about: dict[str, Any],
               health: "Health", lost: "LostKeys") -> Files | None:
    """Open (or create) the tier in ``path``, the index map and the page file bounded by
    ``map_size`` bytes, and register ``namespace`` (described by ``about``), recovering
    first if needed. None when the tier had to be disabled (``health`` says why)."""
    opening = Opening(path, map_size=map_size, namespace=namespace, about=about,
                      health=health, lost=lost)
    return opening.finish() if opening.begin() else None


class Opening:
    """One open of the files in ``path``: :meth:`begin` (quick), then :meth:`finish`
    (which recovers when :attr:`needs_recovery`)."""

    def __init__(self, path: Path, *, map_size: int, namespace: bytes, about: dict[str, Any],
                 health: "Health", lost: "LostKeys") -> None:
        self.path = path
        self.map_size = map_size
        self.namespace = namespace
        self.about = about
        self.health = health
        self.lost = lost
        self.existed = False
        self.snapshot: Snapshot | None = None
        self.why = ""   # why a recovery is needed

    def begin(self) -> bool:
        """Steps 1 and 2: False when the tier had to be disabled."""
        self.existed = _environment_exists(self.path)
        _remove(self.path / REBUILT)  # what a walk killed midway left
        if not _reserve_lock_file(self.path, self.health):
            return False
        snapshot, self.why = take(self.path)  # removed in any case: it speaks for no later state
        if self.existed:
            self.snapshot = snapshot
            if self.snapshot is not None:
                self.why = self.snapshot.check(self.path) or ""
                if self.why:
                    self.snapshot = None
            if self.why and self.why != UNCLEAN:
                log.warning("SSD tier at %s: %s; verifying it in full", self.path, self.why)
        return True

    @property
    def needs_recovery(self) -> bool:
        return self.existed and self.snapshot is None

    def index_bytes(self) -> int:
        """Bytes of ``data.mdb`` (what a recovery walks)."""
        try:
            return (self.path / "data.mdb").stat().st_size
        except OSError:
            return 0

    def finish(self, cancel: Cancel | None = None) -> Files | None:
        """Steps 3 to 7: the open files, or None when the tier had to be disabled or
        ``cancel`` was called. Raises ``ConfigError`` for an environment kvstrata did not
        create."""
        found = self._walk(cancel) if self.needs_recovery else None
        if self.needs_recovery and found is None:
            return None
        index = _open_index(self.path, self.map_size, self.existed, self.health)
        if index is None:
            return None
        files = None
        try:
            dropped = _prepare(self.path, index, self.namespace, self.about, self.health) \
                if _complete(self.path, index, self.health) else None
            if dropped is not None:
                files = self._open_pages(index, None if dropped else found,
                                         None if dropped else self.snapshot)
        finally:
            if files is None:
                index.close()
        if files is not None and cancel is not None and cancel.event.is_set():
            files.close()
            return None
        return files

    def _walk(self, cancel: Cancel | None) -> Survey | None:
        """Step 3: the survey of a walked environment, or None (disabled or cancelled)."""
        try:
            found = walk(self.path, file_size(self.path / BLOCKS), cancel)
            _install_rebuilt(self.path)
        except Cancelled:
            return None
        except OSError as exc:
            self.health.fail(f"cannot swap in the rebuilt index: {exc}")
            return None
        except Foreign:
            raise ConfigError(f"path: {self.path} holds an LMDB environment that kvstrata did "
                              "not create; refusing to use it") from None
        except Damaged as exc:
            when = " after an unclean shutdown" if self.why == UNCLEAN else ""
            self.health.fail(f"the environment does not verify{when} ({exc})")
            return None
        return found if _reserve_lock_file(self.path, self.health) else None

    def _open_pages(self, index: Index, found: Survey | None,
                    snapshot: Snapshot | None) -> Files | None:
        """Open the page file; its free-space map from the snapshot, or from a survey (the
        walk's, else one of the heads in this process: a new or just emptied index, or one
        the snapshot vouched for but whose page file changed)."""
        try:
            pages = PageFile(self.path)
        except (OSError, ConfigError) as exc:
            self.health.fail(f"cannot open {BLOCKS}: {exc}")
            return None
        try:
            limit = self.map_size // PAGE
            space = snapshot.extent_map(limit, pages.size()) if snapshot is not None else None
            counts = snapshot.counts if snapshot is not None else {}
            if space is None:
                if found is None:
                    found = survey(*index.all_heads(), pages.size())
                space, counts = self._apply(index, found, limit)
            if pages.size() > space.high_water * PAGE:
                pages.truncate(space.high_water)
            self._report_foreign(counts)
            return Files(index, pages, space, dict(counts))
        except OSError as exc:
            self.health.fail(f"cannot open {BLOCKS}: {exc}")
        except Exception as exc:  # IndexFailure, or a head LMDB returns malformed
            self.health.fail(f"cannot read the index: {exc!r}")
        pages.close()
        return None

    def _apply(self, index: Index, found: Survey, limit: int
               ) -> tuple[ExtentMap, dict[bytes, int]]:
        """Step 7: delete the bad records, store the used bytes, build the free-space map."""
        with index.write() as tx:
            for nskey in found.bad:
                tx.drop(nskey)
            tx.used = found.used
        if found.bad:
            self.health.count("corrupt_deleted", len(found.bad))
            self.health.log_once("corrupt", "deleted %d records whose header or pages do not "
                                 "verify at open", len(found.bad))
            self.lost.add(found.bad)
        return ExtentMap.from_used(limit, found.starts, found.npages), found.counts

    def _report_foreign(self, counts: dict[bytes, int]) -> None:
        total = sum(counts.values())
        foreign = total - counts.get(self.namespace, 0)
        if foreign:
            log.info("SSD tier at %s: %d of its %d records belong to other fingerprints "
                     "(another model, layout or kvstrata format version); they are not served "
                     "here and, unless another cache reads them, are the first the LRU evicts",
                     self.health.path, foreign, total)


class Background:
    """Finishes an :class:`Opening` on a thread of its own and hands the result (the files,
    or None) to ``done`` on that thread."""

    def __init__(self, opening: Opening, done: Callable[[Files | None], None], name: str) -> None:
        self.opening = opening
        self.cancel = Cancel()
        self._done = done
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)

    def start(self) -> None:
        self._thread.start()

    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the result to be handed over; False on timeout."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Cancel (the walk's child is killed; a survey being applied completes, then its
        files close) and wait for the thread."""
        self.cancel()
        self._thread.join()

    def _run(self) -> None:
        opening = self.opening
        t0 = time.monotonic()
        files = None
        try:
            files = opening.finish(self.cancel)
        except ConfigError as exc:  # found after the constructor returned: disable, not raise
            opening.health.fail(str(exc))
        except Exception as exc:
            opening.health.fail(f"recovery failed: {exc!r}")
            log.exception("SSD tier at %s: recovery failed", opening.path)
        if files is not None:
            log.info("SSD tier at %s: recovered in %.1f s", opening.path, time.monotonic() - t0)
        self._done(files)


def _reserve_lock_file(path: Path, health: "Health") -> bool:
    """Give LMDB's lock file its disk blocks now (it is written through a memory map: on
    a full disk, a SIGBUS). Only allocates; bytes already there are left as they are."""
    try:
        fd = open_private(path / LMDB_LOCK, os.O_RDWR | os.O_CREAT, FILE_MODE)
    except ConfigError as exc:
        health.fail(f"cannot create {LMDB_LOCK}: {exc}")
        return False
    try:
        os.posix_fallocate(fd, 0, max(os.fstat(fd).st_size, LMDB_LOCK_BYTES))
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            health.fail(f"no room for {LMDB_LOCK} ({exc.strerror}); is the disk full?")
            return False
    finally:
        os.close(fd)
    return True



# ====================================================================== steps

def _install_rebuilt(path: Path) -> None:
    """Swap the walk's rebuilt environment in for ``data.mdb``, atomically, with a new lock
    file: the old one's reader table and transaction id speak of the old file (a
    :func:`~kvstrata.tiers.ssd.tier.read_keys` child still reading it keeps its copy)."""
    os.replace(path / REBUILT, path / "data.mdb")
    _remove(path / LMDB_LOCK)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _environment_exists(path: Path) -> bool:
    """An environment is there: ``data.mdb`` holds at least LMDB's two meta pages. A
    shorter one is what a creation that failed (a full disk, a crash) left: removed."""
    try:
        if (path / "data.mdb").stat().st_size >= 2 * PAGE:
            return True
    except FileNotFoundError:
        return False
    _remove_half_made(path)
    return False


def _remove_half_made(path: Path) -> None:
    """Remove the ``data.mdb`` of an environment whose creation failed."""
    try:
        (path / "data.mdb").unlink()
    except FileNotFoundError:
        pass


def _open_index(path: Path, map_size: int, existed: bool, health: "Health") -> Index | None:
    from kvstrata.tiers.ssd.index import DiskFull
    try:
        return Index(path, map_size)
    except IndexFailure as exc:
        if not existed and not isinstance(exc, DiskFull):
            raise ConfigError(f"path: cannot create an LMDB environment in {path}: "
                              f"{exc}") from exc
        if not existed:  # no room for the first pages: nothing half-made stays behind
            _remove_half_made(path)
        full = " (no room on the disk)" if isinstance(exc, DiskFull) else ""
        health.fail(f"cannot {'open' if existed else 'create'} the LMDB environment{full}: {exc}")
        return None


def _complete(path: Path, index: Index, health: "Health") -> bool:
    """A data file shorter than its last page would fault on access: treat it as corrupt."""
    try:
        need = index.data_end()
    except IndexFailure as exc:
        health.fail(f"cannot read the LMDB environment: {exc}")
        return False
    size = (path / "data.mdb").stat().st_size
    if size < need:
        health.fail(f"data.mdb has {size} bytes but its pages reach {need}: "
                    "truncated or half-written")
        return False
    return True


def _prepare(path: Path, index: Index, namespace: bytes, about: dict[str, Any],
             health: "Health") -> bool | None:
    """Refuse an environment kvstrata did not create; set up (or convert) the meta records.
    Whether records of another format were dropped; None when the tier was disabled."""
    try:
        names = index.names()
    except IndexFailure:
        names = []  # unreadable: opening the databases reports it
    if names and b"meta" not in names:
        raise ConfigError(f"path: {path} holds an LMDB environment that kvstrata did not "
                          "create; refusing to use it")
    try:
        index.open_dbs()
        with index.write() as tx:
            dropped = _set_up_meta(path, tx, namespace, about)
        index.sync()
    except IndexFailure as exc:
        health.fail(f"cannot read the LMDB environment: {exc}")
        return None
    return dropped


def _set_up_meta(path: Path, tx: WriteTxn, namespace: bytes, about: dict[str, Any]) -> bool:
    """Whether records of another format were dropped."""
    import msgpack
    now = time.time()
    dropped = False
    info = tx.meta(b"kvstrata")
    if info is None:
        if tx.records():
            raise ConfigError(f"path: {path} holds an LMDB environment that kvstrata did not "
                              "create; refusing to use it")
        _init_meta(tx, now)
    elif _format_of(info) != RECORD_VERSION:
        log.warning("SSD tier at %s: records of format %r are not readable by format %d; "
                    "discarding %d of them", path, _format_of(info), RECORD_VERSION,
                    tx.records())
        tx.drop_all()
        _init_meta(tx, now)
        dropped = True
    key = b"ns:" + namespace
    if tx.meta(key) is None:
        tx.put_meta(key, msgpack.packb({**about, "created_at": now}))
    return dropped


def _init_meta(tx: WriteTxn, now: float) -> None:
    import msgpack
    tx.put_meta(b"kvstrata", msgpack.packb({"format": RECORD_VERSION, "created_at": now}))
    tx.used = tx.clock = 0
