"""The clean-close snapshot (``kvstrata.clean``): what lets a tier reopen without recovery.

Recovery (:mod:`~kvstrata.tiers.ssd.recovery`) costs time in proportion to
the records: a child process walks the whole environment, and the page
file's free-space map is rebuilt from every head. A tier closed cleanly
saves instead what that would find, once the writer's last sync is done and
the environment is closed:

* ``data.mdb``: its size and ``xxh3_128`` digest, as the closed environment
  left it (every page LMDB wrote, meta pages included);
* ``blocks.dat``: its size;
* the free-space map: its limit, where used pages end, and every free extent
  (the whole map: pages freed by deletions are all back in it by then);
* the records per namespace (what the open reports about other fingerprints);
* an ``xxh3_64`` of all of the above.

At the next open the file is read (up to the largest size a snapshot of that page file
can have: a larger one is refused unread) and removed (:func:`take`) before
anything else touches the directory, so that a crash from then on leaves an
unclean tier. The snapshot stands in for recovery only if it verifies and
``data.mdb`` still has exactly that size and digest (:meth:`Snapshot.check`):
the environment is then, byte for byte, one a tier verified, used and closed
(damage while closed, a crash after a later open, a copy from elsewhere, all
change the digest). Hashing reads the file once (about 200 bytes a record),
far less than walking it. A page file of another size, or a capacity that
moves pages out of or into the map in a way it cannot follow, leaves only
the free-space map to rebuild, from heads that are then known to be sound.

Threads: functions of the thread that opens or closes the tier; nothing
shared.
"""

from __future__ import annotations

import errno
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from kvstrata.errors import ConfigError
from kvstrata.tiers.ssd.extents import ExtentMap
from kvstrata.tiers.ssd.pagefile import BLOCKS
from kvstrata.tiers.ssd.private import open_private
from kvstrata.tiers.ssd.record import NS_LEN, PAGE

__all__ = ["Snapshot", "take", "hash_file", "CLEAN", "UNCLEAN"]

CLEAN = "kvstrata.clean"   # the snapshot; its absence at open means an unclean shutdown
UNCLEAN = "not closed cleanly"
_MAGIC = b"kvstrata-clean/2"
assert len(_MAGIC) == 16, "the magic fills its 16-byte field exactly"
# magic, data.mdb size, data.mdb digest, blocks.dat size, limit, used end, free extents, namespaces
_HEAD = struct.Struct("<16sQ16sQQQQQ")
_NS = struct.Struct(f"<{NS_LEN}sQ")
_SUM = struct.Struct("<Q")
_CHUNK = 8 * 1024**2


@dataclass
class Snapshot:
    """What a clean close saw (see the module docstring)."""

    data_size: int
    data_digest: bytes
    blocks_size: int
    limit: int
    used_end: int
    free_starts: np.ndarray
    free_npages: np.ndarray
    counts: dict[bytes, int]

    @classmethod
    def of(cls, space: ExtentMap, counts: dict[bytes, int]) -> "Snapshot":
        """The free-space map and counts of an open tier (sizes and digest: :meth:`save`)."""
        starts, npages = space.free_extents()
        return cls(0, b"", 0, space.limit, space.high_water, starts, npages, dict(counts))

    # ------------------------------------------------------------------ close

    def save(self, path: Path) -> None:
        """Measure the closed files in directory ``path`` and write the snapshot there,
        durably (owner-only). Raises ``OSError``."""
        self.data_size, self.data_digest = hash_file(path / "data.mdb")
        self.blocks_size = (path / BLOCKS).stat().st_size
        body = self._pack()
        try:
            fd = open_private(path / CLEAN, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        except ConfigError as exc:
            raise OSError(errno.EPERM, str(exc)) from None
        try:
            os.write(fd, body + _SUM.pack(xxhash.xxh3_64_intdigest(body)))
            os.fsync(fd)
        finally:
            os.close(fd)
        _sync_dir(path)

    def _pack(self) -> bytes:
        head = _HEAD.pack(_MAGIC, self.data_size, self.data_digest, self.blocks_size,
                          self.limit, self.used_end, len(self.free_starts), len(self.counts))
        extents = np.stack([self.free_starts, self.free_npages]).astype("<i8").tobytes()
        names = b"".join(_NS.pack(ns, n) for ns, n in sorted(self.counts.items())
                         if len(ns) == NS_LEN)
        return head + extents + names

    # ------------------------------------------------------------------ open

    def check(self, path: Path) -> str | None:
        """None if ``data.mdb`` in ``path`` is exactly what this snapshot saw; otherwise
        what differs."""
        try:
            size, digest = hash_file(path / "data.mdb")
        except OSError as exc:
            return f"cannot read data.mdb: {exc.strerror}"
        if size != self.data_size:
            return f"data.mdb has {size} bytes, {self.data_size} at the clean close"
        if digest != self.data_digest:
            return "data.mdb changed since the clean close"
        return None

    def extent_map(self, limit: int, blocks_size: int) -> ExtentMap | None:
        """The free-space map for a map of ``limit`` pages over a page file of
        ``blocks_size`` bytes; None when it must be rebuilt from the heads instead (a page
        file of another size, or a larger limit while records lie past the old one)."""
        if blocks_size != self.blocks_size:
            return None
        starts, npages = self.free_starts, self.free_npages
        if limit < self.limit:  # a smaller capacity: pages past the limit leave the map
            ends = np.minimum(starts + npages, limit)
            keep = starts < ends
            starts, npages = starts[keep], (ends - starts)[keep]
        elif limit > self.limit:  # a larger one: the pages added are free, if nothing is there
            used_end = max(self.used_end, 0)
            if used_end > self.limit:
                return None
            starts, npages = _append_free(starts, npages, self.limit, limit)
        return ExtentMap.from_free(limit, starts, npages, self.used_end)


def take(path: Path) -> tuple[Snapshot | None, str]:
    """Read and remove the snapshot in directory ``path``: it, or None and why not."""
    marker = path / CLEAN
    bound = _largest(path)
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None, UNCLEAN
    except OSError as exc:
        return None, f"cannot read {CLEAN}: {exc.strerror}"
    try:
        data = os.read(fd, bound + 1)  # a larger file is refused unread
    except OSError as exc:
        data = exc
    finally:
        os.close(fd)
    try:
        marker.unlink()
    except OSError as exc:  # it would be found again: cannot be trusted later
        return None, f"cannot remove {CLEAN}: {exc.strerror}"
    if isinstance(data, OSError):
        return None, f"cannot read {CLEAN}: {data.strerror}"
    if len(data) > bound:
        return None, f"{CLEAN} is larger than a snapshot of this tier can be"
    snap = _unpack(data)
    return (snap, "") if snap is not None else (None, f"{CLEAN} does not verify")


def _largest(path: Path) -> int:
    """Bytes of the largest snapshot a tier with this page file can save: its free extents
    lie between used pages (at most one per two pages, plus the tail), one entry per
    namespace (at most 2**16)."""
    try:
        pages = os.lstat(path / BLOCKS).st_size // PAGE
    except OSError:
        pages = 0
    return _HEAD.size + 16 * (pages // 2 + 2) + _NS.size * 2**16 + _SUM.size


def _unpack(data: bytes) -> Snapshot | None:
    if len(data) < _HEAD.size + _SUM.size:
        return None
    body, (digest,) = data[:-_SUM.size], _SUM.unpack(data[-_SUM.size:])
    if xxhash.xxh3_64_intdigest(body) != digest:
        return None
    magic, data_size, data_digest, blocks_size, limit, used_end, nfree, nns = \
        _HEAD.unpack_from(body)
    if magic != _MAGIC or len(body) != _HEAD.size + 16 * nfree + _NS.size * nns:
        return None
    extents = np.frombuffer(body, "<i8", 2 * nfree, _HEAD.size).astype(np.int64).reshape(2, -1)
    at = _HEAD.size + 16 * nfree
    counts = dict(_NS.unpack_from(body, at + i * _NS.size) for i in range(nns))
    return Snapshot(data_size, data_digest, blocks_size, limit, used_end, extents[0].copy(),
                    extents[1].copy(), counts)


def _append_free(starts: np.ndarray, npages: np.ndarray, old: int, new: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Free extents plus the pages ``[old, new)``, merged with a free extent ending at
    ``old``."""
    if len(starts) and starts[-1] + npages[-1] == old:
        npages = npages.copy()
        npages[-1] += new - old
        return starts, npages
    return np.append(starts, old), np.append(npages, new - old)


def hash_file(path: Path) -> tuple[int, bytes]:
    """Size and ``xxh3_128`` digest of a file, read sequentially. Raises ``OSError``."""
    digest = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    size = 0
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while True:
            n = os.readv(fd, [buf])
            if not n:
                return size, digest.digest()
            digest.update(view[:n])
            size += n
    finally:
        os.close(fd)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
