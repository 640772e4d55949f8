"""``blocks.dat``: the SSD tier's payloads, in runs of whole 4 KiB pages.

Bodies are written with ``pwrite`` straight from the encoded block (no page
headers, no intermediate copy) at pages the writer allocated from its
:class:`~tierkv.tiers.ssd.extents.ExtentMap`, and read back with
``pread``/``preadv``. The file has no structure of its own: which pages hold
what is known only from the index.

Threads: one file descriptor, shared without a lock. ``pwrite``/``pread``
take their offset per call, so the writer thread writes pages no head points
to yet while reading threads read pages their heads point to (page reclaim
keeps those two sets apart). Only the writer thread syncs; recovery
truncates before the writer starts; the owner closes after the writer stopped.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from tierkv.tiers.ssd.record import PAGE

__all__ = ["PageFile", "BLOCKS"]

BLOCKS = "blocks.dat"


class PageFile:
    """The page file in directory ``path``, created if missing (owner-only, mode 0o600)."""

    def __init__(self, path: Path) -> None:
        self.path = path / BLOCKS
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)

    def size(self) -> int:
        """Bytes in the file."""
        return os.fstat(self.fd).st_size

    def write(self, data: memoryview, page: int) -> None:
        """Write all of ``data`` at ``page`` (raises ``OSError``: disk full, I/O error)."""
        offset = page * PAGE
        while len(data):
            n = os.pwrite(self.fd, data, offset)
            data, offset = data[n:], offset + n

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
