"""The copier's I/O lanes: SSD work in the order the policy planned it, and remote fetches
on a lane of their own (a disk read that does not return holds its lane only).

Threads: :class:`IOQueue` is called from the copier's owner thread; what it runs runs on
its one thread (or at once, on inline streams).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor as FuturesExecutor
from concurrent.futures import Future, ThreadPoolExecutor
import threading
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from kvstrata.dataplane.executor import Executor, Lost
    from kvstrata.policy.plans import FetchPlan

__all__ = ["IOQueue", "fetch_job", "io_result", "timed"]

log = logging.getLogger(__name__)


class IOQueue:
    """SSD work in plan order (rule 4): one thread, or at once on inline streams."""

    def __init__(self, io: "FuturesExecutor | None", inline: bool, name: str = "kvstrata-io") -> None:
        # one thread: SSD work runs in plan order (tests pass a fake that runs it in a seeded order)
        self._io = io if io is not None else ThreadPoolExecutor(1, thread_name_prefix=name)
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

    @property
    def last_change(self) -> "Future[Any] | None":
        """The latest change of the SSD tier queued (None: none yet)."""
        return self._last_change

    def shutdown(self) -> None:
        self._io.shutdown(wait=True)


def timed(seconds: list[float], fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its wall time in ``seconds[0]``."""
    t0 = time.perf_counter()
    try:
        return fn(*args)
    finally:
        seconds[0] = time.perf_counter() - t0


def io_result(fut: "Future[Lost]") -> "Lost":
    """The blocks an SSD job reports lost (none when the job failed: that is logged)."""
    try:
        return fut.result() or []
    except Exception:
        log.exception("kvstrata: an SSD job failed; its blocks count as lost")
        return []


def fetch_job(ex: "Executor", plan: "FetchPlan", cut: threading.Event, before: "Future[Any] | None",
              switched: "Future[Any] | None", lost: "Lost") -> Callable[[], int]:
    """The fetch lane's job for ``plan``: its reads start once ``switched`` (a move to another
    remote generation queued before it) ran, or fetch nothing if it is cut first; its SSD
    puts are made only if ``before`` (the SSD work queued before it) ran (else dropped,
    into ``lost``)."""

    def run() -> int:
        while switched is not None and not switched.done():  # (a reset: rare) until the cut
            if cut.wait(0.005):
                return ex.fetch(plan, evict=False, stop=lambda: True)  # nothing: its slots emptied
        return ex.fetch(plan, evict=False, stop=cut.is_set, lost=lost, ready=lambda: before is None or before.done())

    return run
