"""The remote tier's write-behind: a queue of blocks bounded in bytes and the one writer
thread that sends it in pipelined batches (:class:`~.tier.RemoteTier` decides what may be
queued; see its module for the rules).

Threads: any thread may call :meth:`WriteBehind.put`, :meth:`WriteBehind.delete`,
:meth:`WriteBehind.flush` and :meth:`WriteBehind.close`; the queue, the deletes and the
spare buffers are guarded by ``_cond``; the writer thread alone sends.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from kvstrata.system.breaker import Breaker
from kvstrata.tiers.remote.client import UNANSWERED, Pipelines
from kvstrata.tiers.remote.value import AUTH_SIZE, Auth, seal, staged, value_bytes
from kvstrata.tiers.remote.watch import INFO_EVERY, ServerWatch
from kvstrata.tiers.ssd.record import Codec

__all__ = ["WriteBehind", "replace_squatters"]


class WriteBehind:
    """Blocks queued for the server (``SET key value NX``, up to ``batch_values`` a batch) and
    deletes of values that did not verify; a put past ``capacity_bytes`` queued is dropped.
    ``start``: run the writer thread (a probing-only tier sends nothing)."""

    def __init__(self, pipes: Pipelines, watch: ServerWatch, breaker: Breaker, codec: Codec, auth: Auth | None, *,
                 block_nbytes: int, capacity_bytes: int, batch_values: int, start: bool = True) -> None:
        self._pipes = pipes
        self.watch = watch
        self.breaker = breaker
        self.codec = codec
        self.auth = auth
        self.block_nbytes = block_nbytes
        self.capacity = capacity_bytes
        self.batch_values = batch_values
        self._cond = threading.Condition()
        self._queue: deque[tuple[bytes, bytearray]] = deque()
        self._deletes: list[bytes] = []
        self._spare: list[bytearray] = []  # sent buffers, reused by put (at most a queue's worth)
        self._queued_bytes = 0
        self._writing = False
        self.closed = False
        self._thread = threading.Thread(target=self._loop, name="kvstrata-remote-writer", daemon=True) \
            if start else None
        if self._thread is not None:
            self._thread.start()

    @property
    def running(self) -> bool:
        """Whether a writer thread sends what is queued."""
        return self._thread is not None

    def put(self, nskey: bytes, row: Any) -> bool:
        """Queue one block (copied now) under ``nskey``; False (counted) when the queue is full."""
        nbytes = int(getattr(row, "nbytes", len(row)))
        with self._cond:
            full = self._queued_bytes + nbytes > self.capacity
            if not full:
                self._queued_bytes += nbytes  # reserved; copied without holding the lock
        if full:
            self.watch.count("dropped_full")
            return False
        with self._cond:
            spare = self._spare.pop() if self._spare else None
        value = staged(row, spare, self.auth)
        with self._cond:
            self._queue.append((nskey, value))
            self._cond.notify()
        self.watch.count("puts")
        return True

    def delete(self, nskey: bytes) -> None:
        """Delete ``nskey`` from the server with the next batch."""
        with self._cond:
            self._deletes.append(nskey)
            self._cond.notify()

    @property
    def queued_bytes(self) -> int:
        with self._cond:
            return self._queued_bytes

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued put and delete was sent (or dropped); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._deletes or self._writing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 0.1)
        return True

    def close(self, timeout: float) -> None:
        """Send what is queued (for at most ``timeout`` seconds), then stop the thread."""
        if self._thread is not None:
            self.flush(timeout)
        with self._cond:
            self.closed = True
            self._queue.clear()
            self._queued_bytes = 0
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._queue or self._deletes or self.closed):
                    self._cond.wait(INFO_EVERY)
                    if not (self._queue or self._deletes or self.closed):
                        break
                if self.closed and not self._queue and not self._deletes:
                    return
                batch = [self._queue.popleft() for _ in range(min(self.batch_values, len(self._queue)))]
                self._queued_bytes -= sum(len(v) - value_bytes(0, self.auth) for _, v in batch)
                deletes, self._deletes = self._deletes, []
                self._writing = True
            try:
                self.watch.maybe_info()
                if batch or deletes:
                    self._write(batch, deletes)
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def _write(self, batch: list[tuple[bytes, bytearray]], deletes: list[bytes]) -> None:
        count = self.watch.count
        if not self.breaker.allow():
            count("dropped_breaker", len(batch))
            return
        try:
            values = [seal(nskey, buf, self.codec, self.auth) for nskey, buf in batch]
            nbytes, replaced = sum(len(v) for v in values), 0
            value_of = {nskey: v for (nskey, _), v in zip(batch, values)}
            results = self._pipes.run([k for k, _ in batch], lambda pipe, k: pipe.set(k, value_of[k], nx=True), 1,
                                      UNANSWERED, strict=False) if batch else []
            if deletes:
                self._pipes.run(deletes, lambda pipe, k: pipe.delete(k), 1, None, strict=False)
            if self.auth is not None:
                replaced, resent = replace_squatters(self._pipes, batch, values, results)
                nbytes += resent
        except Exception as exc:
            count("put_failures", len(batch))
            self.watch.failed("put", exc)
            return
        finally:
            with self._cond:  # the buffers are free again (the pipeline no longer refers to them)
                room = max(0, self.capacity // value_bytes(self.block_nbytes, self.auth) - len(self._spare))
                self._spare.extend(buf for _, buf in batch[:room])
        self.watch.succeeded()
        written = sum(1 for r in results[:len(batch)] if r is True)
        failed = [r for r in results[:len(batch)] if isinstance(r, Exception)]
        count("written", written)
        count("present", len(batch) - written - len(failed) - replaced)
        count("replaced", replaced)
        count("bytes_written", nbytes)
        if failed:  # e.g. OOM under a policy that never evicts: the server is up, the write is not
            count("put_failures", len(failed))
            self.watch.log_once("refused", "remote tier: the server refused writes (%s); dropped and counted",
                                failed[0])


def replace_squatters(pipes: Pipelines, batch: list[tuple[bytes, bytearray]], values: list[Any],
                      results: list[Any]) -> tuple[int, int]:
    """Keys ``SET NX`` found present: those whose value does not start with this writer's
    signature of the same bytes (a planted value, or one signed under another secret or
    encoding) are overwritten. Returns how many, and the bytes sent again."""
    present = [i for i, r in enumerate(results[:len(batch)]) if r is None]
    if not present:
        return 0, 0
    heads = pipes.run([batch[i][0] for i in present], lambda pipe, k: pipe.getrange(k, 0, AUTH_SIZE - 1),
                      1, None, strict=False)
    stale = [i for i, head in zip(present, heads)
             if head is not None and head != bytes(memoryview(values[i])[:AUTH_SIZE])]
    if not stale:
        return 0, 0
    value_of = {batch[i][0]: values[i] for i in stale}
    pipes.run(list(value_of), lambda pipe, k: pipe.set(k, value_of[k]), 1, None, strict=False)
    return len(stale), sum(len(values[i]) for i in stale)
