"""What the scheduler half measures for load or recompute (:mod:`kvstrata.core.costs`).

Everything is timed in the scheduler's own process, from what vLLM's connector API
reports there (no channel beside it): a load from the step that handed it to the
workers to the step whose output reports it finished (the time its request waits), a
fetch from the shared tier the same way, and the engine's steps as the time between
two consecutive ``build_connector_meta`` calls with the tokens the earlier one
scheduled (with vLLM's synchronous scheduling, a step's compute lies in between).

Threads: vLLM's scheduler thread.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Sequence

from kvstrata.core.costs import LoadCosts
from kvstrata.policy import FetchPlan, LoadPlan
from kvstrata.policy.tiers import LOWER, SHARED

if TYPE_CHECKING:
    from kvstrata.config import LoadConfig
    from kvstrata.policy import PolicySpec

__all__ = ["TransferTiming", "load_costs", "IDLE_S"]

IDLE_S = 5.0  # a gap between two steps longer than this is an idle engine, not a step
_PENDING = 1 << 14  # plans timed at most at once


def load_costs(cfg: "LoadConfig", spec: "PolicySpec", block_nbytes: int) -> LoadCosts:
    """The cost model ``load.*`` describes for this deployment's tiers."""
    shared = SHARED[0] if spec.remote else None
    tiers = (*LOWER, *((shared,) if shared else ()))
    fixed = {tier: block_nbytes / bw for tier in tiers if (bw := getattr(cfg, f"{tier}_bandwidth", None))}
    return LoadCosts(LOWER, shared, policy=cfg.policy, margin=cfg.margin, warmup=cfg.warmup, block_seconds=fixed,
                     token_seconds=1.0 / cfg.prefill_rate if cfg.prefill_rate else None)


class TransferTiming:
    """Feeds a :class:`LoadCosts` with the timings of :mod:`kvstrata.connectors.vllm_costs`."""

    def __init__(self, costs: LoadCosts, block_size: int, clock: Any = time.monotonic) -> None:
        self.costs = costs
        self.block_size = block_size
        self.clock = clock
        self._step: tuple[float, int] | None = None  # (when, tokens scheduled) of the last step
        self._loads: dict[int, tuple[float, dict[str, int]]] = {}  # plan id -> (handed over, blocks per tier)
        self._fetches: dict[int, float] = {}

    def step(self, tokens: int, handed: Sequence[LoadPlan | FetchPlan]) -> None:
        """A step was scheduled (``tokens`` to compute) and ``handed`` plans go to the workers."""
        now = self.clock()
        if self._step is not None:
            when, last = self._step
            if last and now - when < IDLE_S:
                self.costs.step_done(last, now - when, self.block_size)
        self._step = (now, int(tokens))
        for plan in handed:
            if isinstance(plan, LoadPlan):
                self._loads[plan.plan_id] = (now, dict(Counter(t for t in plan.tiers() if t)))
            else:
                self._fetches[plan.plan_id] = now
        for pending in (self._loads, self._fetches):  # plans whose completion never came (their request ended)
            while len(pending) > _PENDING:
                del pending[next(iter(pending))]

    def loaded(self, plan: LoadPlan, whole: bool) -> None:
        """A load finished (``whole``: every block arrived; only those are timed)."""
        started = self._loads.pop(plan.plan_id, None)
        if started is not None and whole:
            self.costs.load_done(started[1], self.clock() - started[0])

    def fetched(self, plan: FetchPlan, got: int) -> None:
        started = self._fetches.pop(plan.plan_id, None)
        if started is not None and got == len(plan):
            self.costs.fetch_done(got, self.clock() - started)
