"""Helpers shared by the benchmark scripts (importable as ``benchutil`` when a script runs)."""

from __future__ import annotations

import os
from pathlib import Path


def drop_page_cache(path: str | os.PathLike[str]) -> None:
    """Write back and evict a file's pages (every file of a directory) for a cold read."""
    p = Path(path)
    for f in ([p] if p.is_file() else [c for c in p.iterdir() if c.is_file()]):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
