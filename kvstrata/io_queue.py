"""The copier's I/O thread: SSD work (and remote fetches) in the order the policy planned it.

Threads: :class:`IOQueue` is called from the copier's owner thread; what it runs runs on
its one thread (or at once, on inline streams).
"""

from __future__ import annotations

import time
from concurrent.futures import Executor as FuturesExecutor
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

__all__ = ["IOQueue", "timed"]


class IOQueue:
    """SSD work in plan order (rule 4): one thread, or at once on inline streams."""

    def __init__(self, io: "FuturesExecutor | None", inline: bool) -> None:
        # one thread: SSD work runs in plan order (tests pass a fake that runs it in a seeded order)
        self._io = io if io is not None else ThreadPoolExecutor(1, thread_name_prefix="kvstrata-io")
        self._inline = inline
        self.last: Future[Any] | None = None  # the I/O thread's latest job
        self._last_change: Future[Any] | None = None  # ... and its latest change of the SSD tier

    def submit(self, fn: Callable[..., Any], *args: Any, changes: bool = True) -> "Future[Any]":
        """Run SSD work after the work queued before it. ``changes`` (puts, deletions,
        touches) runs at once when the device copies it depends on run when submitted
        (the CPU backend: the tier's ``put`` only queues; plans then take effect in the
        step that made them, as they did before copies could be asynchronous). Reads of
        the SSD tier always go to the I/O thread: they wait on the disk."""
        if changes and self._inline and (self._last_change is None or self._last_change.done()):
            fut: Future[Any] = Future()
            try:
                fut.set_result(fn(*args))
            except Exception as exc:  # reported where the result is read, as from the thread
                fut.set_exception(exc)
            return fut
        fut = self._io.submit(fn, *args)
        self.last = fut
        if changes:
            self._last_change = fut
        return fut

    def shutdown(self) -> None:
        self._io.shutdown(wait=True)


def timed(seconds: list[float], fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its wall time in ``seconds[0]``."""
    t0 = time.perf_counter()
    try:
        return fn(*args)
    finally:
        seconds[0] = time.perf_counter() - t0
