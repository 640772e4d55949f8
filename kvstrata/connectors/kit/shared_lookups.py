"""The scheduler half's side of the shared tier (the remote tier): probes, then fetch plans.

Per request, what follows the local prefix is probed on the shared tier (``EXISTS``,
on the tier's probe thread); what the server holds is then planned as a fetch into
slab slots (:meth:`~kvstrata.core.driver.DriverCore.plan_fetch`), which the workers
run with the step's loads. :meth:`SharedLookups.ready` is False until both are over,
and vLLM asks again next step. The scheduler waits for probes in flight
:data:`PROBE_WAIT_S` per step at most, all requests together: a server on the
same network answers within it, so a request is answered in the step it arrived
in. Polled instead, a probe's answer crosses three threads while vLLM's busy
engine loop holds the interpreter, each hand-off up to Python's 5 ms switch
interval: a loopback server's 0.2 ms answer reached the scheduler in 6-86 ms.
A request gets one shared lookup: resumed or asked again later, it is answered
from the tiers below as they are by then. The probe's state lives on the request
(:class:`~kvstrata.core.request.RequestState` subclass of the scheduler: ``probe``
and ``shared_done``).

The scheduler's tier owns the replica's namespace generation
(:mod:`kvstrata.tiers.remote.generation`): it joins it at start and bumps it at a
reset (:meth:`SharedLookups.reset`), and every step's metadata tells the workers
which generation to fetch from and write to (:attr:`SharedLookups.generation`).
A reset drops the probes in flight: their answers are of the old generation, and
the request is probed again in the new one.

Threads: vLLM's scheduler thread; the probe runs on the shared tier's thread.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from typing import Any, Mapping, Sequence

from kvstrata.config.schema import KVStrataConfig
from kvstrata.core.driver import DriverCore
from kvstrata.core.request import RequestState
from kvstrata.policy import FetchPlan

__all__ = ["SharedLookups", "WorkerReports"]

log = logging.getLogger(__name__)

#: The longest one scheduler step waits for the shared tier's probes, all requests together.
PROBE_WAIT_S = 0.002


class WorkerReports:
    """Per-plan reports from ``num_workers`` workers: a plan is done once every worker reported it."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self._reports: dict[int, list[int]] = {}

    def add(self, reports: Mapping[int, int | Sequence[int]]) -> list[tuple[int, list[int]]]:
        """Take ``plan id -> count`` (or a list of counts) reports; returns the plans now
        reported by every worker, with every worker's count."""
        for plan_id, counts in reports.items():
            got = self._reports.setdefault(plan_id, [])
            if isinstance(counts, int):
                got.extend([1] * counts)
            else:
                got.extend(counts)
        done = [(p, c) for p, c in self._reports.items() if len(c) >= self.num_workers]
        for plan_id, _ in done:
            del self._reports[plan_id]
        return done

    def __len__(self) -> int:
        return len(self._reports)


class SharedLookups:
    """Probes and fetch plans of one scheduler (see the module docstring), over a reader of the
    remote tier (``remote.*`` of ``cfg``) for the shards ``tier_ids`` of every rank."""

    def __init__(self, core: DriverCore, cfg: KVStrataConfig, tier_ids: list[str], block_nbytes: int,
                 num_workers: int) -> None:
        from kvstrata.tiers.remote import RemoteTier

        self.core = core
        self.tier = RemoteTier.from_config(cfg.remote, tier_ids, block_nbytes, writer=False)
        self._reports = WorkerReports(num_workers)
        self.blocks_fetched = 0
        self._wait_left = PROBE_WAIT_S
        self._settling: cf.Future[Any] | None = None  # a join or bump on the probe thread

    @property
    def generation(self) -> bytes | None:
        """The generation the workers fetch from and write to (None: unknown, nothing is)."""
        return self.tier.generation_token

    def reset(self) -> None:
        """The tiers were reset (the weights changed): move to a new generation (made on the
        probe thread) and drop every probe in flight; each request is probed again in it."""
        self.tier.reset()
        for st in self.core.requests.values():
            if getattr(st, "probe", None) is not None:
                st.probe = None  # type: ignore[attr-defined]
        self._settling = self.tier.settle_async()

    def new_step(self) -> None:
        """A scheduler step begins: it may wait :data:`PROBE_WAIT_S` for probes again (and the
        generation, still unknown after a failed join or bump, is tried again)."""
        self._wait_left = PROBE_WAIT_S
        if self.tier.generation_token is None and (self._settling is None or self._settling.done()):
            self._settling = self.tier.settle_async()

    def ready(self, st: Any, first: int, start: int, last: int) -> bool:
        """May the request be answered now? ``st.hashes[first:start]`` are held below, the
        rest up to ``last`` are not."""
        if st.shared_done:
            return True
        if st.fetch is not None:
            return False
        if st.probe is None:
            st.probe = (start, last, self.tier.probe_async(self.core.all_group_keys(st, start, last),
                                                           each=self.core.groups.each))
        begin, end, future = st.probe
        if not self._done(future):
            return False
        st.probe, st.shared_done = None, True
        try:
            plan = self.core.probe_answered(st, first, start, future.result(), begin, end)
        except Exception:  # the probe thread never raises for the server; a bug must not stop the engine
            log.exception("kvstrata: a remote probe failed")
            plan = None
        if plan is None:
            return True
        st.shared_done = False  # answered once the fetch completed
        return False

    def _done(self, future: "cf.Future[Any]") -> bool:
        """Is the probe answered, within what is left of this step's wait?"""
        if not future.done() and self._wait_left > 0:
            began = time.perf_counter()
            cf.wait([future], timeout=self._wait_left)
            self._wait_left -= time.perf_counter() - began
        return future.done()

    def gathered(self, fetched: Mapping[int, Sequence[int]]) -> list[tuple[int, int]]:
        """Workers' fetch results: the plans every worker ran (plan id, the blocks every rank
        fetched), for :meth:`DriverCore.complete <kvstrata.core.driver.DriverCore.complete>`."""
        return [(plan_id, min(counts)) for plan_id, counts in self._reports.add(fetched)]

    def fetched(self, plan: FetchPlan, got: int) -> None:
        """A fetch plan completed with ``got`` blocks held: its request's probe is done."""
        self.blocks_fetched += got
        st: RequestState | None = self.core.requests.get(plan.req_id)
        if st is not None:
            st.shared_done = True  # type: ignore[attr-defined]

    def stats(self) -> dict[str, Any]:
        return {"blocks_fetched": self.blocks_fetched, **self.tier.stats()}

    def close(self) -> None:
        self.tier.close()
