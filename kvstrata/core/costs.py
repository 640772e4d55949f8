"""Load or recompute: a hit below the device pool is loaded only where loading it beats
computing it again.

What a block costs, measured where it happens, reaches the one place that decides (the
scheduler half's :class:`~kvstrata.core.driver.DriverCore`):

* **loading**: every load the workers finish reports how many blocks it moved from each
  lower tier and how long the copies took (storage to host memory, then into the device
  blocks), a load cut at its deadline too. Each tier's seconds per block and fixed
  latency per load (a seek, a round trip) are the least-squares fit of ``seconds = sum
  over the tiers read of (blocks x seconds per block + latency)`` over the loads seen,
  with older loads weighted down by ``DECAY`` per load, so a change of a tier's speed
  shows within a few loads. A latency is told apart while a tier's recent loads differ
  in size (by ``_SPREAD`` of their mean, weighted as the fit weighs them: hits of many
  lengths, or a probe's few blocks beside whole hits); otherwise it is 0 and the fit goes
  through the origin. A fetch from the remote tier reports
  its blocks and seconds the same way; a remote block then costs its fetch and its load
  from DRAM.
* **computing**: the engine's steps report the tokens they computed, the context those
  tokens attended (``sum over requests of tokens x (tokens before them + tokens / 2)``)
  and how long they took. A step costs a fixed part (scheduling, the launch of every
  layer, sampling), a part per token (the weights) and a part per token and context
  token attended: the decayed least-squares fit of ``seconds = fixed + tokens x per
  token + attended x per attended`` (decode steps anchor the fixed part). Computing a
  hit's blocks instead of loading them adds their tokens to a step the request takes
  anyway, so a block's compute is its tokens' parts: later blocks of a long prompt cost
  more. While the steps do not tell the parts apart, the line without the attended part
  stands in, then their ratio (it counts the fixed part too, which favours loading).

The decision (:meth:`LoadCosts.worth`): over the blocks of a hit in prefix order, the
saving of loading the first ``k`` is ``sum(the block's compute - (1 + margin) x seconds
per block of its tier)``, less ``(1 + margin) x`` the latency of each tier they read;
the hit is cut to the ``k`` of the largest saving (ties: the longer). Along a run of blocks of one tier the saving per block grows with the position,
so the partial sums are convex and only a run's ends can hold the largest. A DRAM prefix can so be loaded while an SSD or
remote tail is computed. Until a tier has ``warmup`` samples (or the compute rate
has), its blocks are loaded (``always``); a measurement that is absent or absurd
(not finite, negative) is ignored. ``overrides`` fix a tier's seconds per block (an
operator's figure: ``load.<tier>_bandwidth``) or the compute rate.

A tier judged slower than computing is not read again, so it could never be seen to
recover: when a hit would compute a tier's blocks and that tier's last sample is older
than ``PROBE_S``, the first ``probe_blocks`` of them (``PROBE_BYTES``, at least one block)
are loaded once more (a probe, bounded by its deadline; the rest of the hit is decided
as usual), and the estimates start again from what the probe measured. A probe so costs
a request at most the time its few blocks take to read, not a whole hit's.

**Queued reads.** The reads of the tiers behind the slab tier (the SSD tier's) run on
one I/O thread, in order: a load handed over behind others waits for their reads. The
estimate of every load in flight is kept from its hand-over (:meth:`LoadCosts.handed`)
to its end (:meth:`LoadCosts.finished`), and what is still ahead
(:class:`~kvstrata.core.read_queue.ReadQueue`: their estimated reads less the time
since the oldest was handed over, and never less than the age of a read out past its
expected time) is charged once to a hit that reads such a tier, and added to its
deadline's estimate. Under a burst of hits on a slow disk, the later ones are then
computed rather than queued. (Fetches from the shared tier run on a lane of their own
and are timed from hand-over, so their estimate already holds their queue; the library
and the replay load one request at a time: nothing is ahead.)

**Stalls.** A load the workers gave up at its deadline with its reads still out
(:meth:`LoadCosts.stalled`: a read that does not return) takes its tier out: its
blocks are computed, but for one probe of ``probe_blocks`` after each cooldown, until
a load of it comes back whole (see :mod:`kvstrata.core.read_queue`).

The deadline (:meth:`LoadCosts.deadline`): a load still running ``deadline`` times its
estimate after it was handed over, or longer than computing its blocks would take
(during a tier's warm-up, the only bound), reads no more; the blocks not yet in are
computed. It is never shorter than two of the engine's recent steps (a load waits for
the step it was handed over in), nor than two of that step (what its tokens cost: an
engine otherwise idle steps in moments). A slow tier then holds a request at most about
as long as computing its blocks, and the cut load still reports what it read; a read
that does not return holds it no longer (the workers report the cut at once).

Threads: the driver's owner thread.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from itertools import groupby
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from kvstrata.core.fit import DECAY, Fit as _Fit, solve as _solve
from kvstrata.core.read_queue import ReadQueue
from kvstrata.config.load import LOAD_POLICIES as POLICIES
from kvstrata.policy.tiers import LOWER, SHARED

if TYPE_CHECKING:
    from kvstrata.config.load import LoadConfig
    from kvstrata.policy import PolicySpec

__all__ = ["LoadCosts", "DECAY", "ALWAYS", "MEASURED", "POLICIES", "PROBE_S", "PROBE_BYTES", "load_costs", "fixed_costs"]

MEASURED, ALWAYS = POLICIES  # (measured, always)
PROBE_S = 60.0  # a tier not read for this long is read once more before it is judged again
PROBE_BYTES = 1 << 20  # what a probe reads of its tier (at least one block)


_GALLOP_FROM = 128  # blocks: below this a hit's runs are found by groupby alone


def _runs(tiers: Sequence[str]) -> list[tuple[str, int]]:  # noqa: C901 (one search, kept whole)
    """``tiers`` as (tier, length) runs, in order. A hit is a few long runs (a DRAM prefix,
    an SSD tail), so each run's end is found by galloping and bisecting on the assumption
    that the run is contiguous, then confirmed by one comparison of the whole run, which
    stays in C; anything else, and a short hit (where :func:`itertools.groupby` is as
    fast), goes to ``groupby``. About 1.5x faster than ``groupby`` alone over a 512-block
    hit (``benchmarks/bench_core.py``)."""
    tiers = tiers if type(tiers) is list else list(tiers)
    n, i, out = len(tiers), 0, []
    if n < _GALLOP_FROM:
        return [(k, len(list(run))) for k, run in groupby(tiers)]
    while i < n:
        t = tiers[i]
        lo, step = i + 1, 1  # tiers[i:lo] are t; tiers[lo + step - 1] is looked at next
        while lo + step <= n and tiers[lo + step - 1] == t:
            lo, step = lo + step, step * 2
        hi = min(n, lo + step - 1)  # tiers[hi] is not t (or hi == n)
        while lo < hi:
            mid = (lo + hi) // 2
            if tiers[mid] == t:
                lo = mid + 1
            else:
                hi = mid
        if tiers[i:lo] != [t] * (lo - i):  # not contiguous after all
            return out + [(k, len(list(run))) for k, run in groupby(tiers[i:])]
        out.append((t, lo - i))
        i = lo
    return out


def _sane(seconds: Any) -> bool:
    return isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds) \
        and seconds > 0


class LoadCosts:
    """The estimates and the decision of :mod:`kvstrata.core.costs`. ``tiers``: the lower
    tiers a load reads (the slab tier first), ``fetched``: the tier fetched into the slab
    tier before its load (the shared one), ``block_seconds``: fixed seconds per block of a
    tier, ``latency_seconds``: a fixed latency per load of such a tier (0 by default),
    ``token_seconds`` and ``attended_seconds``: a fixed compute rate (seconds per token,
    and per token and context token it attends)."""

    def __init__(self, tiers: Sequence[str], fetched: str | None = None, *, policy: str = ALWAYS,
                 margin: float = 0.1, warmup: int = 1, block_seconds: Mapping[str, float] | None = None,
                 latency_seconds: Mapping[str, float] | None = None, token_seconds: float | None = None,
                 attended_seconds: float = 0.0, deadline: float = 2.0, probe_blocks: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tiers = tuple(tiers)
        self.probe_blocks = max(1, int(probe_blocks))
        self.fetched = fetched
        self.policy, self.margin, self.warmup = policy, float(margin), int(warmup)
        self.deadline_factor = float(deadline)
        self.clock = clock
        self._sampled: dict[str, float] = {}  # tier -> when it was last measured (or probed)
        self._probing: set[str] = set()        # tiers whose probe has not reported yet
        self.fixed = dict(block_seconds or {})
        self.fixed_latency = {t: float((latency_seconds or {}).get(t, 0.0)) for t in self.fixed}
        self.fixed_token = token_seconds
        self.fixed_attended = float(attended_seconds)
        self._loads = _Fit(self.tiers)
        self._estimates: tuple[dict[str, float], dict[str, float]] | None = None  # until the next sample
        self._fetches = _Fit((fetched,)) if fetched else None
        self._xx = [[0.0] * 3 for _ in range(3)]  # decayed normal equations over (1, tokens, attended)
        self._xy = [0.0] * 3
        self._rates: tuple[float, float] | None = None  # (per token, per attended), until the next step
        self._steps = 0         # steps of at least a block's tokens seen
        self._step_s = 0.0  # decayed seconds and count of every step
        self._step_n = 0.0
        self.decisions = {t: {"loaded": 0, "recomputed": 0} for t in (*self.tiers, *((fetched,) if fetched else ()))}
        self.reads = ReadQueue(lambda: self.clock())  # loads whose reads queue on the I/O thread; stalled tiers
        self._queued_tiers = frozenset(self.tiers[1:])  # read on the I/O thread: behind the slab tier

    @property
    def deciding(self) -> bool:
        """Whether hits are weighed at all (``always`` loads them without looking)."""
        return self.policy != ALWAYS

    # ------------------------------------------------------------------ measurements

    def load_done(self, blocks: Mapping[str, int], seconds: float) -> None:
        """A load read ``blocks[tier]`` blocks from each tier in ``seconds`` (hand-over to completion)."""
        for tier in (t for t in self.tiers if blocks.get(t, 0) > 0):
            self.reads.read(tier)  # read, and not given up: a stalled tier is back
        if _sane(seconds) and any(blocks.get(t, 0) > 0 for t in self.tiers):
            probed = {t for t in self._probing if blocks.get(t, 0) > 0}
            if probed:  # a fresh look: what the tier did before the probe no longer counts
                self._probing -= probed
                self._loads = _Fit(self.tiers)
            self._loads.add(blocks, float(seconds))
            self._estimates = None
            now = self.clock()
            self._sampled.update((t, now) for t in self.tiers if blocks.get(t, 0) > 0)

    def handed(self, plan_id: int, blocks: Mapping[str, int]) -> None:
        """A load reading ``blocks[tier]`` blocks per tier went to the workers: the reads of
        the tiers behind the slab tier queue on one I/O thread until :meth:`finished`."""
        if not self.deciding:
            return
        queued = {t: n for t, n in blocks.items() if t in self._queued_tiers and n > 0}
        reads = self.load_seconds(queued)
        if reads > 0:
            self.reads.handed(plan_id, reads, queued)

    def finished(self, plan_id: int) -> None:
        """The load finished: its reads are no longer ahead of anything (unless it was given
        up with them still out: :meth:`stalled`)."""
        self.reads.finished(plan_id)

    def stalled(self, plan_id: int, tiers: Sequence[str]) -> None:
        """The workers gave the load up at its deadline with its reads of ``tiers`` still out
        (before :meth:`finished`): the reads stay ahead until :meth:`returned`, and the
        queued tiers among ``tiers`` are taken out until a probe of them succeeds."""
        self.reads.stalled(plan_id, [t for t in tiers if t in self._queued_tiers])

    def returned(self, plan_id: int) -> None:
        """The reads of a load given up with them still out have returned."""
        self.reads.returned(plan_id)

    def queued(self) -> float:
        """Seconds of reads still ahead of a new load's (:meth:`ReadQueue.ahead`)."""
        return self.reads.ahead()

    def fetch_done(self, blocks: int, seconds: float) -> None:
        """A fetch brought ``blocks`` blocks from the shared tier into the slab tier in ``seconds``."""
        if self._fetches is not None and blocks > 0 and _sane(seconds):
            self._fetches.add({self.fetched: blocks}, float(seconds))  # type: ignore[dict-item]
            self._estimates = None
            self._sampled[self.fetched] = self.clock()  # type: ignore[index]

    def step_done(self, tokens: int, seconds: float, block_tokens: int, attended: float = 0.0) -> None:
        """An engine step computed ``tokens`` tokens, which attended ``attended`` (see the
        module docstring), in ``seconds``."""
        if _sane(seconds):
            self._step_s = self._step_s * DECAY + seconds
            self._step_n = self._step_n * DECAY + 1
        if tokens >= 1 and _sane(seconds) and math.isfinite(attended) and attended >= 0:
            x = (1.0, float(tokens), float(attended))
            for i in range(3):
                self._xy[i] = self._xy[i] * DECAY + x[i] * seconds
                for j in range(3):
                    self._xx[i][j] = self._xx[i][j] * DECAY + x[i] * x[j]
            self._rates = None
            self._steps += tokens >= block_tokens

    # ------------------------------------------------------------------ estimates

    def token_seconds(self) -> float | None:
        """Seconds to compute one token (its weights' part), or None until ``warmup`` steps."""
        rates = self.compute_rates()
        return None if rates is None else rates[0]

    def compute_rates(self) -> tuple[float, float] | None:
        """(seconds per token, seconds per token and context token attended), or None until
        ``warmup`` steps were seen (a fixed ``token_seconds`` comes with its ``attended_seconds``)."""
        if self.fixed_token is not None:
            return self.fixed_token, self.fixed_attended
        if self._steps < self.warmup:
            return None
        if self._rates is None:
            self._rates = self._fit_rates()
        return self._rates if self._rates[0] > 0 else None

    def _fit_rates(self) -> tuple[float, float]:
        xx, xy = self._xx, self._xy
        full = _solve(xx, xy)
        if full is not None and full[1] > 0 and full[2] >= 0:
            return full[1], full[2]
        line = _solve([row[:2] for row in xx[:2]], xy[:2])
        if line is not None and line[1] > 0:
            return line[1], 0.0
        return (xy[0] / xx[0][1] if xx[0][1] > 0 else 0.0), 0.0

    def compute_seconds(self, first: int, tokens: int) -> float | None:
        """Seconds to compute ``tokens`` tokens after ``first`` others (None: not known yet)."""
        rates = self.compute_rates()
        if rates is None:
            return None
        per_token, per_attended = rates
        return tokens * per_token + per_attended * tokens * (first + tokens / 2)

    def block_seconds(self) -> dict[str, float]:
        """Seconds to load one block from each tier with enough samples (or a fixed figure)."""
        return self._fitted()[0]

    def latency(self) -> dict[str, float]:
        """Fixed seconds a load pays once per tier it reads (a seek, a round trip), for the
        tiers of :meth:`block_seconds`: 0 while its loads do not tell it apart."""
        return self._fitted()[1]

    def load_seconds(self, blocks: Mapping[str, int]) -> float:
        """Seconds a load of ``blocks[tier]`` blocks from each tier takes: every block's
        seconds, and each tier's latency once (a tier without an estimate costs nothing)."""
        cost, latency = self._fitted()
        return sum(n * cost.get(t, 0.0) + latency.get(t, 0.0) for t, n in blocks.items() if n > 0)

    def _fitted(self) -> tuple[dict[str, float], dict[str, float]]:
        if self._estimates is None:
            self._estimates = self._fit_loads()
        return self._estimates

    def _fit_loads(self) -> tuple[dict[str, float], dict[str, float]]:
        per_block, latency = self._loads.solve()
        out = {t: per_block[t] for t in self.tiers if t in per_block and self._loads.seen[t] >= self.warmup}
        lat = {t: latency[t] for t in out}
        if self._fetches is not None and self._fetches.seen[self.fetched] >= self.warmup and self.tiers:
            slab = self.fixed.get(self.tiers[0], out.get(self.tiers[0]))
            if slab is not None:  # a fetched block is then loaded from the slab tier
                f_block, f_latency = self._fetches.solve()
                out[self.fetched] = f_block[self.fetched] + slab  # type: ignore[index]
                lat[self.fetched] = f_latency[self.fetched] + self.fixed_latency.get(  # type: ignore[index]
                    self.tiers[0], lat.get(self.tiers[0], 0.0))
        out.update(self.fixed)
        lat.update(self.fixed_latency)
        return out, lat

    def estimates(self) -> dict[str, Any]:
        """What ``stats()`` shows: the policy, seconds per block of each tier, seconds per token."""
        rates = self.compute_rates()
        return {"policy": self.policy, "block_seconds": self.block_seconds(), "latency_seconds": self.latency(),
                "token_seconds": None if rates is None else rates[0],
                "attended_seconds": None if rates is None else rates[1]}

    # ------------------------------------------------------------------ the decision

    def worth(self, tiers: Sequence[str], block_tokens: int, first: int = 0) -> int:
        """How many leading blocks of a hit to load (``tiers[i]``: where block ``first + i``
        of the prompt is read from); the rest are computed. Nothing is counted (see
        :meth:`count`); of a tier due for a probe (``PROBE_S``) the first ``probe_blocks``
        are loaded whatever they cost, and its probe is then taken. A stalled tier's blocks
        (:meth:`stalled`) are computed, and so is every block after them, but for its probe."""
        if not self.deciding or not tiers:
            return len(tiers)
        if self.reads.stalls():  # rare: a tier's reads did not return
            cut, probing = self._stall_cut(tiers)
            if probing or not cut:
                return cut
            tiers = tiers[:cut]
        rates = self.compute_rates()
        if rates is None:
            return len(tiers)
        per_token, per_attended = rates
        bt = block_tokens
        cost, latency = self._fitted()
        margin = 1.0 + self.margin
        now = self.clock()
        last = bt * per_token + per_attended * bt * bt * (first + len(tiers) - 0.5)  # the costliest block
        runs = _runs(tiers)
        probe = {t for t, _ in runs if self._due(t, cost, now) and last < margin * cost[t]}
        self._take_probes(set(probe), now)
        best_k, best, total, k = 0, 0.0, 0.0, 0
        wait = self.queued()  # paid once, by the first block read on the I/O thread
        paid: set[str] = set()  # tiers whose latency the load already pays
        for tier, n in runs:  # along a run the saving per block grows: its ends decide
            if wait and tier in self._queued_tiers:
                total -= margin * wait
                wait = 0.0
            if tier not in paid:
                paid.add(tier)
                total -= margin * latency.get(tier, 0.0)
            if tier in probe:  # the probe's blocks are read whatever they cost (its first run's), and so
                probe.discard(tier)  # is every block before them: the cut is never shorter than the probe
                free = min(n, self.probe_blocks)
                k, n = k + free, n - free
                best_k, best = k, total
            if n:  # blocks first+k .. first+k+n-1: sum of (position + 1/2) is n(p0) + n^2/2
                p0 = first + k
                total += n * bt * per_token + per_attended * bt * bt * (n * p0 + n * n / 2) \
                    - n * margin * cost.get(tier, 0.0)
                k += n
                if total >= best:
                    best_k, best = k, total
        return best_k

    def worth_whole(self, tiers: Sequence[str], blocks: int, block_tokens: int, first: int = 0) -> bool:
        """Whether a hit that is loaded whole or not at all (a hybrid model's: its groups'
        blocks arrive together) is worth loading: ``tiers`` are where each of its entries is
        read from (every group's blocks), ``blocks`` the positions it covers from block
        ``first``. It is when reading every entry, by ``margin``, takes no longer than
        computing the positions; a tier due for a probe, or not yet measured, is loaded."""
        if not self.deciding or not tiers or blocks <= 0:
            return True
        cut, probing = self._stall_cut(tiers)
        if probing or cut < len(tiers):
            return probing
        compute = self.compute_seconds(first * block_tokens, blocks * block_tokens)
        if compute is None:
            return True
        cost = self.block_seconds()
        now = self.clock()
        due = {t for t in tiers if self._due(t, cost, now)}
        load = (1.0 + self.margin) * self.load_seconds(Counter(tiers))
        if due and load > compute:  # a probe: this hit is loaded, its sample decides again
            self._take_probes(due, now)
            return True
        return load <= compute

    def _stall_cut(self, tiers: Sequence[str]) -> tuple[int, bool]:
        """How many leading blocks may be read while a queued tier is stalled: up to its first
        block, or, when it is due for its probe, ``probe_blocks`` of it (then True)."""
        if not self.reads.stalls():
            return len(tiers), False
        k = 0
        for tier, n in _runs(tiers):
            probe = self.reads.probe(tier) if tier in self._queued_tiers else None
            if probe is not None:
                return (k + min(n, self.probe_blocks), True) if probe else (k, False)
            k += n
        return k, False

    def _due(self, tier: str, cost: Mapping[str, float], now: float) -> bool:
        """A measured tier whose last sample is older than ``PROBE_S``."""
        return tier in cost and tier not in self.fixed and now - self._sampled.get(tier, now) > PROBE_S

    def _take_probes(self, tiers: set[str], now: float) -> None:
        """``tiers`` are read once more: one request probes; its sample (or the next probe) decides."""
        for t in tiers:
            self._sampled[t] = now
        self._probing |= tiers

    def deadline(self, tiers: Sequence[str], block_tokens: int, first: int = 0,
                 blocks: int | None = None, step_tokens: int | None = None) -> float | None:
        """Seconds after its hand-over at which a load of blocks read from ``tiers`` (blocks
        ``first ..`` of the prompt; ``blocks`` positions, default one per tier entry) reads no
        more (None: it runs to the end: ``always``, no deadline factor, no compute rate yet).
        ``step_tokens``: what the step it is handed over in computes; the two steps it is
        never shorter than are then at most two such steps (an engine otherwise idle steps
        in moments, however long its prefills were)."""
        span = len(tiers) if blocks is None else blocks
        limit = self.compute_seconds(first * block_tokens, span * block_tokens) if tiers else None
        if not self.deciding or self.deadline_factor <= 0 or limit is None:
            return None
        if all(t in self.block_seconds() for t in tiers):
            ahead = self.queued() if self._queued_tiers.intersection(tiers) else 0.0
            limit = min(limit, self.deadline_factor * (self.load_seconds(Counter(tiers)) + ahead))
        step = self._step_s / self._step_n if self._step_n else 0.0
        this = self.compute_seconds(0, step_tokens) if step_tokens is not None else None
        return max(limit, 2 * (step if this is None else min(step, this)))

    def count(self, tiers: Sequence[str], loaded: int) -> None:
        """Count a decision: the first ``loaded`` of ``tiers`` are loaded, the rest computed."""
        for i, tier in enumerate(tiers):
            if tier in self.decisions:
                self.decisions[tier]["loaded" if i < loaded else "recomputed"] += 1


def load_costs(cfg: "LoadConfig", spec: "PolicySpec", block_nbytes: int, policy: str | None = None) -> LoadCosts:
    """The cost model ``load.*`` describes for this deployment's tiers (``policy``: instead
    of ``load.policy``)."""
    shared = SHARED[0] if spec.shared else None
    tiers = (*LOWER, *((shared,) if shared else ()))
    fixed = {tier: block_nbytes / bw for tier in tiers if (bw := getattr(cfg, f"{tier}_bandwidth", None))}
    latency = {tier: lat for tier in fixed if (lat := getattr(cfg, f"{tier}_latency", None))}
    return LoadCosts(LOWER, shared, policy=policy or cfg.policy, margin=cfg.margin, warmup=cfg.warmup,
                     block_seconds=fixed, latency_seconds=latency, token_seconds=1.0 / cfg.prefill_rate if cfg.prefill_rate else None,
                     attended_seconds=1.0 / cfg.attention_rate if cfg.attention_rate else 0.0, deadline=cfg.deadline,
                     probe_blocks=PROBE_BYTES // max(1, block_nbytes))


def fixed_costs(cfg: "LoadConfig", spec: "PolicySpec", block_nbytes: int, policy: str | None = None
                ) -> LoadCosts | None:
    """:func:`load_costs` when ``load.*`` fixes every figure this deployment's tiers need
    (``prefill_rate``, and the bandwidth of each lower tier it has), for drivers that measure
    nothing (the replay); None otherwise."""
    costs = load_costs(cfg, spec, block_nbytes, policy)
    capacity = spec.capacity()
    have = [t for t in LOWER if capacity.get(t)] + ([costs.fetched] if costs.fetched else [])
    if costs.fixed_token is None or any(t not in costs.fixed for t in have):
        return None
    return costs
