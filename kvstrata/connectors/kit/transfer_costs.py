"""What the scheduler half measures for load or recompute (:mod:`kvstrata.core.costs`).

Nothing travels beside vLLM's connector API: a load's copies are timed by the workers,
which report the blocks moved per tier and the seconds in the connector's worker
metadata (``loads_done``); a fetch from the shared tier is timed here from the step that
handed it over to the step whose output reports it. An engine step is timed from its
``build_connector_meta`` to its output: the first scheduler-side call that comes from it
(:meth:`TransferTiming.ended`: vLLM's ``take_events``, which it makes for every output, or
a finished request), else the next step's ``build_connector_meta``; with the tokens it
scheduled and the context they attended. With vLLM's synchronous scheduling the step's
compute lies in between, and an engine that then waits for requests does not count its
wait as compute. With asynchronous scheduling the next step is scheduled before the
output of this one arrives, so steps are timed from one ``build_connector_meta`` to the
next (the engine's cadence while busy). The engine's first step that computes anything
is left out: it carries one-time start-up work. A
load still running past its deadline (:meth:`LoadCosts.deadline`, from its hand-over)
is named in the next step's metadata (``cut``): the workers read no more of it, and
report it at once with what is in; one whose reads were still out then (a read that
does not return) is reported ``stalled``, which takes its tier out of the decision until
a probe of it succeeds (:meth:`TransferTiming.stalled`), and ``returned`` once they came
back.

Threads: vLLM's scheduler thread.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable, Sequence

from kvstrata.core.costs import LoadCosts, load_costs
from kvstrata.policy import FetchPlan, LoadPlan

__all__ = ["TransferTiming", "load_costs", "attended", "IDLE_S"]

IDLE_S = 5.0  # a step that took longer than this was an idle engine (its output unseen), not a step
_PENDING = 1 << 14  # plans timed at most at once


class TransferTiming:
    """Feeds a :class:`LoadCosts` with the timings of :mod:`kvstrata.connectors.kit.transfer_costs`."""

    def __init__(self, costs: LoadCosts, block_size: int, clock: Any = time.monotonic,
                 first_of: Callable[[str], int] = lambda req_id: 0,
                 span_of: Callable[[LoadPlan], int] = len, async_scheduling: bool = False) -> None:
        self.costs = costs
        self.block_size = block_size
        self.clock = clock
        self.first_of = first_of  # request -> blocks before its hit (where its load starts)
        self.span_of = span_of    # load plan -> the block positions it covers (with groups, fewer than its entries)
        self._step: tuple[float, int, float] | None = None  # (when, tokens scheduled, attended) of the last step
        self._ended: float | None = None  # when the last step's output arrived (None: not yet seen)
        self._marks = not async_scheduling  # an output arrives before the next step is scheduled
        self._computed = False  # a step that computed anything was seen (the first is not timed)
        self._cut_at: dict[int, tuple[str, float]] = {}  # load or fetch plan id -> (request, when it is cut)
        self._fetches: dict[int, float] = {}  # fetch plan id -> handed over
        self._given_up: dict[str, int] = {}  # request -> its load plan given up with reads still out

    def step(self, tokens: int, handed: Sequence[LoadPlan | FetchPlan], attended: float = 0.0) -> list[str]:
        """A step was scheduled (``tokens`` to compute, attending ``attended``: see
        :mod:`kvstrata.core.costs`) and ``handed`` plans go to the workers; returns the
        requests whose loads are past their deadlines (each named once)."""
        now = self.clock()
        if self._step is not None:
            when, last, att = self._step
            took = (self._ended if self._ended is not None else now) - when
            if last and took < IDLE_S and self._computed:
                self.costs.step_done(last, took, self.block_size, att)
            self._computed = self._computed or bool(last)
        self._step, self._ended = (now, int(tokens), float(attended)), None
        due = [plan_id for plan_id, (_, at) in self._cut_at.items() if at <= now]
        cut = [self._cut_at.pop(plan_id)[0] for plan_id in due]  # each named once
        for plan in handed:
            if isinstance(plan, LoadPlan):
                tiers = [t for t in plan.tiers() if t]
                span = self.span_of(plan)
            else:
                self._fetches[plan.plan_id] = now
                tiers = [self.costs.fetched or ""] * len(plan)
                span = len(plan)
            limit = self.costs.deadline(tiers, self.block_size, self.first_of(plan.req_id), span, step_tokens=tokens)
            if isinstance(plan, LoadPlan):
                self.costs.handed(plan.plan_id, Counter(tiers))  # behind the reads of the loads before it
            if limit is not None:
                self._cut_at[plan.plan_id] = (plan.req_id, now + limit)
        for pending in (self._cut_at, self._fetches):  # plans whose completion never came
            while len(pending) > _PENDING:
                del pending[next(iter(pending))]
        return cut

    def ended(self) -> None:
        """The last step's output arrived (the first call counts; see the module docstring)."""
        if self._marks and self._ended is None and self._step is not None:
            self._ended = self.clock()

    def reported(self, read: dict[str, int], seconds: float) -> None:
        """The workers finished a load that moved ``read`` blocks per tier in ``seconds``."""
        self.costs.load_done(read, seconds)

    def loaded(self, plan: LoadPlan) -> None:
        """A load finished (its deadline no longer runs, its reads are ahead of nothing)."""
        self._cut_at.pop(plan.plan_id, None)
        self.costs.finished(plan.plan_id)

    def stalled(self, plan: LoadPlan) -> None:
        """The workers gave ``plan`` up at its deadline with its reads still out."""
        self.costs.stalled(plan.plan_id, [t for t in plan.tiers() if t])
        self._given_up[plan.req_id] = plan.plan_id
        while len(self._given_up) > _PENDING:
            del self._given_up[next(iter(self._given_up))]

    def returned(self, req_id: str) -> None:
        """The reads of a load given up with them out have returned (they are ahead of nothing)."""
        plan_id = self._given_up.pop(req_id, None)
        if plan_id is not None:
            self.costs.returned(plan_id)

    def fetched(self, plan: FetchPlan, got: int) -> None:
        """A fetch reported ``got`` blocks (a cut one too: what arrived in the time it took)."""
        started = self._fetches.pop(plan.plan_id, None)
        self._cut_at.pop(plan.plan_id, None)
        if started is not None and got > 0:
            self.costs.fetch_done(got, self.clock() - started)


def attended(scheduler_output: Any) -> float:
    """What a step's tokens attend: over its requests, ``tokens x (computed before + tokens / 2)``."""
    scheduled = scheduler_output.num_scheduled_tokens
    out = 0.0
    for new in scheduler_output.scheduled_new_reqs:
        t = scheduled.get(new.req_id, 0)
        out += t * (new.num_computed_tokens + t / 2)
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, done in zip(cached.req_ids, cached.num_computed_tokens):
        t = scheduled.get(req_id, 0)
        out += t * (done + t / 2)
    return out
