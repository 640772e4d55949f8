"""Opening the SSD tier's files, and repairing what a crash or damage left behind.

First, :func:`prepare_directory`: a directory that holds neither an LMDB
environment nor only tierkv's own files is refused, untouched
(``ConfigError``); otherwise it is created if missing, and it and its files
are made owner-only (0700, 0600) whatever the umask. The tier then takes the
directory's lock (:mod:`~tierkv.tiers.ssd.owner`), and :func:`open_files`
goes on, before anything touches an existing environment:

1. LMDB's lock file gets its disk blocks up front: LMDB writes it through a
   memory map, where a full disk is a SIGBUS instead of an error. No room
   for them disables the tier.
2. The environment is walked in a child process: a damaged B-tree (bit rot, a
   torn write, a crash mid-sync) can make LMDB abort() or fault with SIGBUS on
   the first page it reaches, and the child takes that risk. This runs after a
   clean shutdown too (damage can happen while closed); the clean marker only
   says what to log.
3. ``data.mdb`` must be as long as its last page, or access would fault.
4. An LMDB environment that tierkv did not create is refused, untouched.
5. Records of another record format are discarded (logged): they cannot be read.
6. The page file's free-space map is rebuilt from the heads: records whose head
   does not verify, whose body lies past the end of ``blocks.dat`` or overlaps
   an earlier record's pages are deleted (counted, reported lost); the used
   bytes are recounted; pages no head points to (a crash between ``pwrite``
   and commit) are free again; the file is cut after its last used page.

A failure in steps 1-6 disables the tier (logged once with the path); it
never raises, except ``ConfigError`` for a directory that is not ours.

Threads: runs on the thread that constructs the tier, before its writer
starts; nothing here is shared until :func:`open_files` returns.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from tierkv.errors import ConfigError
from tierkv.tiers.ssd.extents import ExtentMap
from tierkv.tiers.ssd.index import Index, IndexFailure, WriteTxn, parse_head
from tierkv.tiers.ssd.pagefile import BLOCKS, PageFile
from tierkv.tiers.ssd.record import PAGE, RECORD_VERSION, record_footprint

if TYPE_CHECKING:
    from tierkv.tiers.ssd.health import Health
    from tierkv.tiers.ssd.lost import LostKeys

__all__ = ["Files", "open_files", "prepare_directory", "owner_only", "mark_clean", "CLEAN", "FILE_MODE",
           "DIR_MODE"]

log = logging.getLogger("tierkv.tiers.ssd")

CLEAN = "tierkv.clean"   # written at a clean close; its absence at open means an unclean shutdown
DIR_MODE = 0o700         # KV bytes derive from users' prompts: owner-only at rest
FILE_MODE = 0o600
LMDB_LOCK = "lock.mdb"
LMDB_LOCK_BYTES = 8192   # what LMDB sizes its lock file to (126 reader slots); more is fine

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


@dataclass
class Files:
    """An open tier's files: the index, the page file and the page file's free-space map
    (owned by the writer thread once it starts)."""

    index: Index
    pages: PageFile
    space: ExtentMap

    def close(self) -> None:
        self.pages.close()
        self.index.close()


def open_files(path: Path, *, map_size: int, namespace: bytes, about: dict[str, Any],
               health: "Health", lost: "LostKeys") -> Files | None:
    """Open (or create) the tier in ``path``, the index map and the page file bounded by
    ``map_size`` bytes, and register ``namespace`` (described by ``about``). None when
    the tier had to be disabled (``health`` says why)."""
    existed = _environment_exists(path)
    if not _reserve_lock_file(path, health):
        return None
    if existed and not _verified(path, health):
        return None
    index = _open_index(path, map_size, existed, health)
    if index is None:
        return None
    try:
        ready = _complete(path, index, health) and _prepare(path, index, namespace, about,
                                                            health)
    except BaseException:
        index.close()
        raise
    files = _open_pages(path, index, map_size, namespace, health, lost) if ready else None
    if files is None:
        index.close()
    return files


def prepare_directory(path: Path) -> None:
    """Refuse a directory that is not a tier's; create ``path`` if missing; make it and
    the files tierkv keeps there owner-only (logged when they were not). The directory
    and every file in it must belong to this user and no file may be a symbolic link:
    another user who could plant them (a shared scratch disk) would read the KV, forge
    records, or have an open truncate a file of their choosing."""
    from tierkv.tiers.ssd.owner import LOCK_FILE
    ours = {LMDB_LOCK, CLEAN, BLOCKS, LOCK_FILE}
    if path.exists() and not (path / "data.mdb").exists() and not {
            p.name for p in path.iterdir()} <= ours:
        raise ConfigError(f"path: {path} is a non-empty directory without an LMDB "
                          "environment; refusing to write into it")
    path.mkdir(mode=DIR_MODE, exist_ok=True)
    owner_only(path, DIR_MODE)
    for name in ours | {"data.mdb"}:
        if os.path.lexists(path / name):
            owner_only(path / name, FILE_MODE)


def owner_only(path: Path, mode: int) -> None:
    """``path`` (not a symbolic link, unless a directory) belongs to this user; set ``mode``
    when it grants more, and say so (an older tier, a loose umask). A ConfigError
    otherwise."""
    try:
        st = os.stat(path) if path.is_dir() else os.lstat(path)
    except OSError as exc:
        raise ConfigError(f"path: cannot inspect {path}: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode) or not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise ConfigError(f"path: {path} is not a regular file (a symbolic link?); refusing it")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"path: {path} belongs to uid {st.st_uid}, not to this user "
                          f"({os.geteuid()}); refusing to keep KV there")
    was = st.st_mode & 0o777
    if was & ~mode:
        try:
            os.chmod(path, mode)
        except OSError as exc:
            raise ConfigError(f"path: cannot make {path} owner-only: {exc.strerror}") from None
        log.warning("SSD tier: %s was readable by others (mode %o); now %o", path, was, mode)


def _reserve_lock_file(path: Path, health: "Health") -> bool:
    """Give LMDB's lock file its disk blocks now (it is written through a memory map: on
    a full disk, a SIGBUS). Only allocates; bytes already there are left as they are."""
    try:
        fd = os.open(path / LMDB_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
    except OSError as exc:
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


def mark_clean(path: Path, health: "Health") -> None:
    """Record a clean close (the next open logs damage as such, not as a crash)."""
    try:
        os.close(os.open(path / CLEAN, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE))
    except OSError as exc:  # the directory went away or is read-only: next open re-verifies
        health.log_once("close", "cannot write the clean marker: %s", exc)


# ====================================================================== steps

def _verified(path: Path, health: "Health") -> bool:
    """Walk an existing environment in a child process before this one touches it."""
    marker = path / CLEAN
    clean = marker.exists()
    if clean:
        marker.unlink()
    problem = walk_in_subprocess(path)
    if problem is not None:
        when = "" if clean else " after an unclean shutdown"
        health.fail(f"the environment does not verify{when} ({problem})")
        return False
    return True


def walk_in_subprocess(path: Path, timeout: float = 600.0) -> str | None:
    """None if a child process can walk the whole environment; otherwise what went wrong."""
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
    from tierkv.tiers.ssd.index import DiskFull
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
             health: "Health") -> bool:
    """Refuse an environment tierkv did not create; set up (or convert) the meta records."""
    try:
        names = index.names()
    except IndexFailure:
        names = []  # unreadable: opening the databases reports it
    if names and b"meta" not in names:
        raise ConfigError(f"path: {path} holds an LMDB environment that tierkv did not "
                          "create; refusing to use it")
    try:
        index.open_dbs()
        with index.write() as tx:
            _set_up_meta(path, tx, namespace, about)
        index.sync()
    except IndexFailure as exc:
        health.fail(f"cannot read the LMDB environment: {exc}")
        return False
    return True


def _set_up_meta(path: Path, tx: WriteTxn, namespace: bytes, about: dict[str, Any]) -> None:
    import msgpack
    now = time.time()
    info = tx.meta(b"tierkv")
    if info is None:
        if tx.records():
            raise ConfigError(f"path: {path} holds an LMDB environment that tierkv did not "
                              "create; refusing to use it")
        _init_meta(tx, now)
    elif _format_of(info) != RECORD_VERSION:
        log.warning("SSD tier at %s: records of format %r are not readable by format %d; "
                    "discarding %d of them", path, _format_of(info), RECORD_VERSION,
                    tx.records())
        tx.drop_all()
        _init_meta(tx, now)
    key = b"ns:" + namespace
    if tx.meta(key) is None:
        tx.put_meta(key, msgpack.packb({**about, "created_at": now}))


def _init_meta(tx: WriteTxn, now: float) -> None:
    import msgpack
    tx.put_meta(b"tierkv", msgpack.packb({"format": RECORD_VERSION, "created_at": now}))
    tx.used = tx.clock = 0


def _format_of(info: bytes) -> object:
    import msgpack
    try:
        return msgpack.unpackb(info).get("format")
    except Exception:  # a damaged meta record: treated as an unknown format
        return None


def _open_pages(path: Path, index: Index, map_size: int, namespace: bytes, health: "Health",
                lost: "LostKeys") -> Files | None:
    """Open the page file and rebuild its free-space map from the heads."""
    try:
        pages = PageFile(path)
    except OSError as exc:
        health.fail(f"cannot open {BLOCKS}: {exc}")
        return None
    try:
        return Files(index, pages, _rebuild(index, pages, map_size, namespace, health, lost))
    except OSError as exc:
        health.fail(f"cannot open {BLOCKS}: {exc}")
    except Exception as exc:  # IndexFailure, or a head LMDB returns malformed
        health.fail(f"cannot read the index: {exc!r}")
    pages.close()
    return None


def _rebuild(index: Index, pages: PageFile, map_size: int, namespace: bytes, health: "Health",
             lost: "LostKeys") -> ExtentMap:
    """Drop records that do not verify, recount the used bytes, free every other page;
    say how many records belong to other namespaces (this cache never reads them)."""
    size = pages.size()
    with index.write() as tx:
        good, bad = _survey(tx.heads(), size)
        for nskey in bad:
            tx.drop(nskey)
        tx.used = sum(fp for _, _, fp in good.values())
    if bad:
        health.count("corrupt_deleted", len(bad))
        health.log_once("corrupt", "deleted %d records whose header or pages do not verify "
                        "at open", len(bad))
        lost.add(bad)
    foreign = sum(1 for nskey in good if not nskey.startswith(namespace))
    if foreign:
        log.info("SSD tier at %s: %d of its %d records belong to other fingerprints (another "
                 "model, layout or tierkv format version); they are not served here and, "
                 "unless another cache reads them, are the first the LRU evicts",
                 health.path, foreign, len(good))
    space = ExtentMap(map_size // PAGE, [(p, n) for p, n, _ in good.values() if n])
    if size > space.high_water * PAGE:
        pages.truncate(space.high_water)
    return space


def _survey(heads: Iterable[tuple[bytes, bytes]], size: int
            ) -> tuple[dict[bytes, tuple[int, int, int]], list[bytes]]:
    """Split heads into good ones (nskey -> page, pages, footprint) and the keys of bad
    ones: unverifiable, past the end of a page file of ``size`` bytes, or overlapping."""
    good: dict[bytes, tuple[int, int, int]] = {}
    bad: list[bytes] = []
    for nskey, head in heads:
        hdr = parse_head(head)
        if hdr is None:
            bad.append(nskey)
            continue
        body_len = hdr.payload_len - hdr.tail_len
        if body_len and hdr.page * PAGE + body_len > size:
            bad.append(nskey)  # its body was never written in full (a torn file)
            continue
        good[nskey] = (hdr.page, hdr.pages, record_footprint(len(nskey), hdr.payload_len))
    extents: dict[tuple[int, int], bytes] = {}
    for k, (p, n, _) in sorted(good.items()):  # two heads on one extent: one of them is wrong
        if n and extents.setdefault((p, n), k) != k:
            bad.append(k)
            del good[k]
    for extent in ExtentMap.overlapping(extents):
        bad.append(extents[extent])
        del good[extents[extent]]
    return good, bad
