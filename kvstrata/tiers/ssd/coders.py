"""Threads that compress a write batch and decompress and verify a read batch.

zstd, numpy and xxhash release the GIL, so a batch of compressed blocks is
(de)coded several times faster on a few threads, each with its own zstd
context (see :class:`~kvstrata.tiers.ssd.record.Codec`). Raw blocks gain
nothing, so a tier without compression never starts the threads.

Threads: the writer thread and reading threads all submit work; the pool is
made on first use under :attr:`Coders.lock` and shut down by the owner at
close, after the writer stopped.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Sequence, TypeVar

__all__ = ["Coders", "CODER_THREADS"]

CODER_THREADS = min(4, os.cpu_count() or 1)  # threads (de)coding one batch

T = TypeVar("T")


class Coders:
    """A lazily started pool of :data:`CODER_THREADS` threads, used when ``parallel``."""

    def __init__(self, parallel: bool) -> None:
        self.parallel = parallel
        self.lock = threading.Lock()
        self._pool: Any = None

    def map(self, fn: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
        """``[fn(x) for x in items]``, on the pool when there are several items to share."""
        if not self.parallel or len(items) < 2 or CODER_THREADS < 2:
            return [fn(x) for x in items]
        with self.lock:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor
                self._pool = ThreadPoolExecutor(CODER_THREADS,
                                                thread_name_prefix="kvstrata-ssd-codec")
        try:
            results = self._pool.map(fn, items)  # submits every item now
        except RuntimeError:  # the interpreter is exiting (a close from atexit): no new work for threads
            return [fn(x) for x in items]
        return list(results)

    def close(self) -> None:
        with self.lock:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None
