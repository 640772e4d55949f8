"""``blocks.dat``: the SSD tier's payloads, in runs of whole 4 KiB pages.

Bodies are written straight from the encoded blocks (no page headers, no
intermediate copy) at pages the writer allocated from its
:class:`~kvstrata.tiers.ssd.extents.ExtentMap`: the bodies of a run of adjacent
pages go down in one ``pwritev`` (each padded to whole pages, up to
``IOV_MAX`` buffers a call), and the kernel is asked to start writing them to
the disk at once (``sync_file_range``, where there is one), so that the next
sync waits for less. They are read back with ``pread``/``preadv``. The file
has no structure of its own: which pages hold what is known only from the
index.

Threads: one file descriptor, shared without a lock. ``pwrite``/``pread``
take their offset per call, so the writer thread writes pages no head points
to yet while reading threads read pages their heads point to (page reclaim
keeps those two sets apart). Only the writer thread syncs; recovery
truncates before the writer starts; the owner closes after the writer stopped.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

from kvstrata.tiers.ssd.private import open_private
from kvstrata.tiers.ssd.record import PAGE

__all__ = ["PageFile", "BLOCKS"]

BLOCKS = "blocks.dat"
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_ZEROS = memoryview(bytes(PAGE))   # padding up to the next page boundary


def _libc_sync_file_range() -> Any:
    try:
        import ctypes
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux: the sync does all of the writing
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Have the kernel start writing these bytes to the disk now (without waiting), so
    that the next sync finds less to do. Only a hint."""
    if _SYNC_FILE_RANGE is not None and nbytes > 0:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class PageFile:
    """The page file in directory ``path``, created if missing (owner-only, mode 0o600);
    a ConfigError when it is not provably the tier's own (:mod:`~kvstrata.tiers.ssd.private`)."""

    def __init__(self, path: Path) -> None:
        self.path = path / BLOCKS
        self.fd = open_private(self.path, os.O_RDWR | os.O_CREAT)

    def size(self) -> int:
        """Bytes in the file."""
        return os.fstat(self.fd).st_size

    def write_run(self, page: int, bodies: Sequence[Any]) -> None:
        """Write ``bodies`` (bytes-likes) one after another from ``page``, each starting on
        a page boundary (zeros fill the rest of a body's last page). Raises ``OSError``."""
        iov: list[Any] = []
        for body in bodies:
            iov.append(body)
            pad = -len(body) % PAGE
            if pad:
                iov.append(_ZEROS[:pad])
        start = offset = page * PAGE
        for first in range(0, len(iov), _IOV_MAX):
            offset = self._writev(iov[first:first + _IOV_MAX], offset)
        _start_writeback(self.fd, start, offset - start)

    def _writev(self, iov: list[Any], offset: int) -> int:
        """Write every buffer of ``iov`` at ``offset`` (resuming after a short write);
        return the offset past the last byte."""
        while iov:
            n = os.pwritev(self.fd, iov, offset)
            if n <= 0:
                raise OSError(errno.EIO, f"pwritev wrote nothing at offset {offset}")
            offset += n
            done = 0
            while done < len(iov) and n >= len(iov[done]):
                n -= len(iov[done])
                done += 1
            iov = iov[done:]
            if n:
                iov[0] = memoryview(iov[0])[n:]
        return offset

    def read(self, page: int, nbytes: int) -> bytes:
        """Up to ``nbytes`` from ``page`` (fewer where the file ends)."""
        return os.pread(self.fd, nbytes, page * PAGE)

    def read_into(self, view: memoryview, page: int) -> int:
        """Fill ``view`` from ``page``; return the bytes read (fewer where the file ends)."""
        return os.preadv(self.fd, [view], page * PAGE)

    def prefetch(self, extents: Iterable[tuple[int, int]]) -> None:
        """Have the kernel start reading these ``(page, pages)`` extents at once: the disk
        serves them in parallel and in any order, where one read at a time waits for each
        in turn. Adjacent and overlapping extents become one request. Only a hint, and
        none for a single extent."""
        wanted = sorted(e for e in extents if e[1])
        if len(wanted) < 2:
            return
        runs: list[list[int]] = []
        for page, pages in wanted:
            if runs and runs[-1][1] >= page:
                runs[-1][1] = max(runs[-1][1], page + pages)
            else:
                runs.append([page, page + pages])
        try:
            for first, end in runs:
                os.posix_fadvise(self.fd, first * PAGE, (end - first) * PAGE,
                                 os.POSIX_FADV_WILLNEED)
        except OSError:
            pass

    def truncate(self, pages: int) -> None:
        os.ftruncate(self.fd, pages * PAGE)

    def sync(self) -> None:
        """Make every write so far durable."""
        os.fdatasync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
