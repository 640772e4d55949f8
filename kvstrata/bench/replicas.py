"""Several replicas behind a router, sharing a remote tier: ``kvstrata bench --replicas N``.

Each replica is a full :class:`~kvstrata.bench.replay.Replayer` (its own GPU pool,
tier policy, DRAM and SSD tiers) driving the same policy the plugin runs; the
replicas of one fleet share a :class:`SharedTierModel`, the Redis/Valkey tier
without bytes. A trace's requests go to the replicas in arrival order, by one
of :data:`ROUTINGS`:

* ``round_robin``: request ``i`` to replica ``i mod N`` (a router that knows
  nothing of the caches);
* ``prefix``: to the replica that holds the longest prefix of the request's
  blocks in its pool or the tiers below (what a prefix-aware router learns
  from the KV-cache events, scoring every tier alike), among the replicas
  that have not taken more than ``1 + LOAD_SLACK`` times their fair share of
  the requests so far (consistent hashing with bounded loads: without a
  bound, a prefix every request shares, such as a system prompt, sends all
  traffic to one replica); among equals the one that took the fewest.

Four fleets replay the trace side by side in one pass (each routing with and
without the shared tier), so a streamed trace is read once and the report can
say what the shared tier adds to each replica under each routing.

The shared tier is :class:`~kvstrata.bench.remote.SharedTierModel`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

from kvstrata.bench.remote import SharedTierModel, shared_capacity_blocks, shared_capacity_bytes
from kvstrata.bench.replay import (ReplayError, ReplayOptions, ReplayResult, Replayer, config_for_trace, replaying,
                                 requests_of)
from kvstrata.config.schema import KVStrataConfig
from kvstrata.errors import ConfigError
from kvstrata.bench.diagnose import label
from kvstrata.policy.events import TIERS
from kvstrata.policy.tiers import SHARED

if TYPE_CHECKING:
    from kvstrata.trace.reader import Request, Trace, TraceReader

__all__ = ["ROUTINGS", "SharedTierModel", "Fleet", "ReplicasResult", "hit_tiers", "replay_replicas", "shared_blocks"]

ROUTINGS = ("round_robin", "prefix")
LOAD_SLACK = 0.25  # prefix routing: a replica takes at most 1.25x its share of the requests so far


def hit_tiers(results: Iterable[ReplayResult]) -> tuple[str, ...]:
    """The tiers a fleet's hits are counted in: the replicas' own (:attr:`ReplayResult.tiers`,
    the device pool first), then the shared tier, with or without one (one table for all)."""
    local = dict.fromkeys(t for res in results for t in res.tiers)
    return (*(local or TIERS), *SHARED)


def shared_blocks(config: KVStrataConfig, block_size: int) -> int:
    """Blocks of the trace's size the shared tier holds (``remote.capacity``)."""
    if not config.cpu.capacity:
        raise ReplayError("--replicas: blocks from the shared tier are fetched into DRAM slots before they "
                          "are served; set cpu.capacity")
    if not shared_capacity_bytes(config):
        raise ReplayError("--replicas: set remote.capacity, the shared tier's size "
                          "(for example --set remote.capacity=256GiB)")
    try:
        return shared_capacity_blocks(config_for_trace(config, block_size))
    except ConfigError as exc:
        raise ReplayError(str(exc)) from None


@dataclass
class Fleet:
    """N replicas, one routing, with or without the shared tier."""

    routing: str
    shared: bool
    replicas: list[Replayer]
    model: SharedTierModel | None  # the shared tier they share (None: without one)
    sent: list[int] = field(default_factory=list)   # requests per replica
    results: list[ReplayResult] = field(default_factory=list)

    def route(self, r: "Request", i: int) -> int:
        if self.routing == "round_robin":
            return i % len(self.replicas)
        bound = math.ceil((1 + LOAD_SLACK) * (i + 1) / len(self.replicas))
        prompt = self.replicas[0].prompt_of(r)  # (one block size for the whole fleet)
        best, chosen = (-1, 0), 0
        for n, rp in enumerate(self.replicas):
            if self.sent[n] >= bound:
                continue
            rp.finish_until(r.timestamp)
            score = (rp.held_prefix(prompt), -self.sent[n])
            if score > best:
                best, chosen = score, n
        return chosen

    def step(self, r: "Request", i: int) -> None:
        n = self.route(r, i)
        self.sent[n] += 1
        self.replicas[n].step(r)

    def hits(self) -> dict[str, int]:
        return {t: sum(res.hit_blocks.get(t, 0) for res in self.results) for t in hit_tiers(self.results)}

    def accesses(self) -> int:
        return sum(res.accesses for res in self.results)


@dataclass
class ReplicasResult:
    num_replicas: int
    shared_blocks: int
    block_size: int
    fleets: list[Fleet]
    requests: int
    wall_s: float

    def fleet(self, routing: str, shared: bool) -> Fleet:
        return next(f for f in self.fleets if f.routing == routing and f.shared == shared)


def replay_replicas(trace: "Trace | TraceReader", config: KVStrataConfig, num_replicas: int,
                    options: ReplayOptions = ReplayOptions(),
                    routings: Iterable[str] = ROUTINGS,
                    progress: Callable[[int], None] | None = None) -> ReplicasResult:
    """Replay ``trace`` on ``num_replicas`` replicas of ``config`` per routing, with and
    without a shared tier of ``remote.capacity`` (see the module docstring)."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas: expected at least 1, got {num_replicas}")
    routings = list(routings)
    bad = [r for r in routings if r not in ROUTINGS]
    if bad:
        raise ValueError(f"routings: expected some of {ROUTINGS}, got {bad}")
    t0 = time.perf_counter()
    stream = requests_of(trace)
    first = next(stream, None)  # (a streamed trace knows its block size from its first request)
    capacity = shared_blocks(config, trace.block_size)
    fleets: list[Fleet] = []
    requests = 0
    with contextlib.ExitStack() as stack:
        for routing, shared in itertools.product(routings, (False, True)):
            model = SharedTierModel(capacity) if shared else None
            reps = [stack.enter_context(replaying(config, trace.block_size, options, model))
                    for _ in range(num_replicas)]
            fleets.append(Fleet(routing, shared, reps, model, [0] * num_replicas))
        for i, r in enumerate(itertools.chain(() if first is None else (first,), stream)):
            for fleet in fleets:
                fleet.step(r, i)
            requests = i + 1
            if progress is not None and requests & 255 == 0:
                progress(requests)
    for fleet in fleets:
        fleet.results = [rp.result for rp in fleet.replicas if rp.result is not None]
    return ReplicasResult(num_replicas, capacity, trace.block_size, fleets, requests, time.perf_counter() - t0)


def replicas_report(res: ReplicasResult) -> dict[str, Any]:
    """The report as plain data (``--json``): per fleet and replica, hits per tier."""
    tiers = hit_tiers(r for f in res.fleets for r in f.results)

    def rates(hits: dict[str, int], accesses: int) -> dict[str, float]:
        n = accesses or 1
        out = {t: round(hits.get(t, 0) / n, 4) for t in tiers}
        out["total"] = round(sum(hits.get(t, 0) for t in tiers) / n, 4)
        return out

    fleets = []
    for f in res.fleets:
        fleets.append({
            "routing": f.routing, "shared_tier": f.shared,
            "hit_rate": rates(f.hits(), f.accesses()),
            "replicas": [{"requests": sent, "accesses": r.accesses, "hit_blocks": dict(r.hit_blocks),
                          "hit_rate": rates(r.hit_blocks, r.accesses)}
                         for sent, r in zip(f.sent, f.results)],
            # the model's own counts, under the name statistics give the shared tier
            SHARED[0]: dict(f.model.counts, held=len(f.model)) if f.model is not None else None,
        })
    return {"replicas": res.num_replicas, "remote_capacity_blocks": res.shared_blocks,
            "block_size": res.block_size, "requests": res.requests, "fleets": fleets,
            "wall_s": round(res.wall_s, 3)}


def render_replicas(report: dict[str, Any]) -> str:
    """The report as text: a table per fleet, then what the shared tier adds."""
    names = {"round_robin": "round robin", "prefix": "prefix-aware"}
    first = report["fleets"][0]["hit_rate"] if report["fleets"] else dict.fromkeys((*TIERS, *SHARED, "total"))
    tiers = [t for t in first if t != "total"]
    lines = [f"kvstrata bench: {report['replicas']} replicas, {report['requests']:,} requests, "
             f"a shared tier of {report['remote_capacity_blocks']:,} blocks of {report['block_size']} tokens",
             "",
             f"{'routing':<14}{'shared tier':<13}" + "".join(f"{label(t):>8}" for t in tiers) + f"{'total':>8}"
             + "   total per replica (requests)",
             ]
    for f in report["fleets"]:
        hr = f["hit_rate"]
        per = "  ".join(f"{r['hit_rate']['total']:.1%} ({r['requests']:,})" for r in f["replicas"])
        lines.append(f"{names[f['routing']]:<14}{'with' if f['shared_tier'] else 'without':<13}"
                     + "".join(f"{hr[t]:>8.1%}" for t in (*tiers, "total")) + f"   {per}")
    lines += ["", "Prefix hit rate: blocks served from cache (prefix-contiguous) / blocks requested."]
    by = {(f["routing"], f["shared_tier"]): f for f in report["fleets"]}
    for routing in dict.fromkeys(f["routing"] for f in report["fleets"]):
        without, with_ = by.get((routing, False)), by.get((routing, True))
        if without is None or with_ is None:
            continue
        gain = with_["hit_rate"]["total"] - without["hit_rate"]["total"]
        per = ", ".join(f"{b['hit_rate']['total'] - a['hit_rate']['total']:+.1%}"
                        for a, b in zip(without["replicas"], with_["replicas"]))
        lines.append(f"The shared tier adds {gain:+.1%} of hits with {names[routing]} routing "
                     f"(per replica: {per}).")
    return "\n".join(lines) + "\n"
