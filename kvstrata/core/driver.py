"""The step protocol, written once for every driver.

:class:`DriverCore` is what the library's :class:`~kvstrata.library.tiered.TieredKVCache`,
the vLLM connector's scheduler half and the ``kvstrata bench`` replay have in
common. It tells the :class:`~kvstrata.policy.TierPolicy` what a driver's device
pool did, keeps each request's state (:class:`~kvstrata.core.request.RequestState`),
the plans prepared and those running, and counts where every hit came from.
A driver adds only what differs for it:

* who owns the device pool (the library's and the replay's own
  :class:`~kvstrata.pool.blocks.BlockManager`, or vLLM's), and so which blocks
  are hits, evicted, computed or in the page-out window;
* whether plans complete at once (:meth:`DriverCore.run`, :meth:`DriverCore.lookup_now`)
  or a step later, reported by workers (:meth:`DriverCore.take_planned`, then
  :meth:`DriverCore.complete`);
* whether bytes move at all (the executor it runs plans on);
* where time comes from (the policy's clock).

A request's steps, in order:

1. :meth:`~DriverCore.held_below`: how many blocks after the device prefix the
   tiers below hold (pure). With a remote tier, what follows is probed there
   and fetched into CPU slots first (:meth:`~DriverCore.plan_fetch`): a remote
   block is a hit only once its bytes are local.
2. :meth:`~DriverCore.admit`: the driver's pool allocated the request. The
   device hits are touched below (a use of every copy), the lookup is counted,
   and the load is planned (its sources pinned).
3. :meth:`~DriverCore.end_step`: the step's store offers, in the one order:
   blocks the pool evicted (copied before any row is rewritten), newly
   computed blocks, the page-out window.
4. Completion (:meth:`~DriverCore.complete`): stores, then fetches, then loads. A load's hits are counted by the tier
   that served each block (:func:`~kvstrata.core.hits.served_from`) once it
   completed, and only the blocks that arrived.
5. :meth:`~DriverCore.finish`: plans not yet handed to an executor are
   cancelled; a load already running keeps the request's blocks until it
   completes.

Threads: not thread-safe; the driver's one owner thread calls every method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence, TypeVar

from kvstrata.core.costs import LoadCosts
from kvstrata.identity.groups import KVGroups
from kvstrata.core.hits import GPU, HitCounts, count_tiers, request_counts, served_from
from kvstrata.core.request import RequestState
from kvstrata.policy.plans import COMPUTED, EVICTED, PAGEOUT, SHUTDOWN, FetchPlan, LoadPlan, StorePlan

if TYPE_CHECKING:
    from kvstrata.dataplane.executor import Executor, LoadResult
    from kvstrata.policy.manager import TierPolicy

__all__ = ["DriverCore", "Blocks", "Completed"]

S = TypeVar("S", bound=RequestState)
Blocks = Sequence[tuple[int, bytes]]  # (device block id, key) pairs
Lost = Iterable[tuple[str, bytes]]


@dataclass
class Completed:
    """What :meth:`DriverCore.complete` completed: store plans, fetch plans (with the blocks
    fetched) and loads (the request's state, its plan, the positions that arrived)."""

    stores: list[StorePlan]
    fetches: list[tuple[FetchPlan, int]] = field(default_factory=list)
    loads: list[tuple[RequestState, LoadPlan, int]] = field(default_factory=list)


class DriverCore:
    """The protocol of :mod:`kvstrata.core.driver` over one policy (``block_size`` tokens a block).

    ``groups``: the model's KV-cache groups (:mod:`kvstrata.identity.groups`; by default one
    full-attention group). A request's blocks are stored and loaded per group under the
    group's keys (:meth:`~kvstrata.core.request.RequestState.group_key`; group 0's are the
    chain's), a hit is the longest prefix every group can serve, device block ids are per
    group (a block table each), and how much of a hit a load serves is the groups' rule
    (:meth:`KVGroups.cut`,
    :meth:`KVGroups.served`: with one full-attention group, any prefix of it).
    """

    def __init__(self, policy: "TierPolicy", block_size: int, groups: KVGroups | None = None,
                 costs: LoadCosts | None = None) -> None:
        self.policy = policy
        self.block_size = block_size
        self.groups = groups if groups is not None else KVGroups.one(block_size)
        self.costs = costs  # load or recompute (kvstrata.core.costs); None: every hit is loaded
        policy.order_context.block_tokens = block_size  # what the eviction orders weigh a block by
        self.shared = bool(policy.spec.shared)
        self.tiers = count_tiers(policy)
        self.counts = HitCounts(self.tiers)    # new requests: the hit rate
        self.resumed = HitCounts(self.tiers)   # requests looked up again after a preemption
        self.requests: dict[str, RequestState] = {}
        self.gpu_evictions = 0
        self.stored_at_eviction = 0
        self._planned: list[LoadPlan | FetchPlan] = []      # prepared, not yet handed to an executor
        self._loading: dict[str, RequestState] = {}         # loads handed over, not complete
        self._fetching: dict[int, tuple[FetchPlan, RequestState]] = {}  # planned or running
        self._storing: dict[int, StorePlan] = {}            # handed over, not complete

    # ------------------------------------------------------------------ requests

    def open(self, state: S) -> S:
        """Follow ``state``'s request from now on (replacing any state of the same id)."""
        self.requests[state.req_id] = state
        return state

    def finish(self, req_id: str) -> tuple[RequestState | None, bool]:
        """The request finished: forget it and cancel its plans no executor has yet. Returns
        its state and whether a load into its blocks is still running (the driver must not
        free them before :meth:`load_finished`)."""
        st = self.requests.pop(req_id, None)
        cancelled = [p for p in self._planned if p.req_id == req_id]
        if cancelled:
            self._planned = [p for p in self._planned if p.req_id != req_id]
            for plan in cancelled:
                if isinstance(plan, LoadPlan):
                    self.policy.complete_load(plan, loaded=0)
                    if st is not None:
                        st.load = None
                else:
                    self._fetching.pop(plan.plan_id, None)
                    self.policy.complete_fetch(plan, 0)
        return st, req_id in self._loading

    @property
    def planned(self) -> tuple[LoadPlan | FetchPlan, ...]:
        """The loads and fetches prepared and not yet handed to an executor, in order."""
        return tuple(self._planned)

    def busy(self) -> int:
        """Loads and fetches planned or running (a reset of the tiers waits for none)."""
        return sum(isinstance(p, LoadPlan) for p in self._planned) + len(self._loading) + len(self._fetching)

    def idle(self) -> bool:
        """Nothing planned or running, and no request followed (a drained driver)."""
        return not (self._planned or self._loading or self._fetching or self._storing or self.requests)

    # ------------------------------------------------------------------ lookups

    def held_below(self, st: RequestState, first: int, last: int, note: bool = True) -> int:
        """Blocks of ``st.hashes[first:last]``, from the first, that the tiers below hold: the
        longest such hit every group can serve. Places nothing; an eviction order that weighs
        reaches (``cost``) learns how far the keys up to ``last`` reach (:meth:`_note`; not
        with ``note`` False: a router's question)."""
        if note and self.policy.order_context.learning:
            self._note(st, last)
        holds, lookup = self.policy.holds, self.policy.lookup

        def held(g: int, i: int) -> bool:
            return holds(st.group_key(g, i)) is not None

        def run(g: int, lo: int, hi: int) -> int:
            return len(lookup(st.keys_of(g, lo, hi)))

        reach = self.groups.full_end(first, last, held, run)
        self._reached(st, last, reach)
        return self.groups.window_end(first, reach, held) - first

    @staticmethod
    def _reached(st: RequestState, last: int, reach: int) -> None:
        """``st``'s full-attention prefix is held below up to ``reach`` (a shared prefix's junction,
        kept once seen): with the prompt's end ``last``, where later hits of its blocks can end."""
        junction = max(reach, st.ends[1] if len(st.ends) > 1 else 0)
        st.ends = (last, junction) if junction < last else (last,)

    def _note(self, st: RequestState, last: int) -> None:
        """``st``'s first ``last`` keys, which reach block ``last - 1``, and the compute's attention
        share where it is measured (or fixed by ``load.*``), for the eviction orders that weigh
        them (:class:`~kvstrata.policy.orders.OrderContext`)."""
        context = self.policy.order_context
        context.note(st.hashes, last)
        rates = self.costs.compute_rates() if self.costs is not None else None
        if rates is not None and rates[0] > 0 and rates[1] > 0:
            context.attention_share = rates[1] / rates[0]

    def worth_loading(self, st: RequestState, first: int, below: int) -> int:
        """How many of the ``below`` blocks after ``first`` are worth loading rather than
        computing, over every group's blocks the hit needs (:meth:`KVGroups.cut`: a prefix of
        it, :meth:`LoadCosts.worth`, or all or none, :meth:`LoadCosts.worth_whole`); the
        decision is counted when the request is admitted."""
        if self.costs is None or not self.costs.deciding or not below:
            return below
        tiers, _ = self._hit_tiers(st, first, first + below)
        k, entries = self._cut(tiers, first, below)
        st.decision = (tiers, entries)
        return k

    def _cut(self, tiers: Sequence[str], first: int, blocks: int) -> tuple[int, int]:
        """:meth:`KVGroups.cut` of a hit of ``blocks`` positions from ``first`` read from ``tiers``."""
        costs, bs = self.costs, self.block_size
        assert costs is not None
        return self.groups.cut(tiers, blocks, lambda t: costs.worth(t, bs, first),
                               lambda t: costs.worth_whole(t, blocks, bs, first))

    def _hit_tiers(self, st: RequestState, first: int, end: int, start: int | None = None) -> tuple[list[str], int]:
        """Where each block a hit ``[first, end)`` needs is read from, group by group (from
        ``start`` on: the shared tier's, fetched first), and how many are fetched."""
        fetched = (self.costs.fetched if self.costs is not None else None) or ""
        out: list[str] = []
        shared = 0
        for g, lo in self.groups.entries(first, end):
            mid = end if start is None else max(lo, start)
            out += self._tiers(st.keys_of(g, lo, mid))
            out += [fetched] * (end - mid)
            shared += end - mid
        return out, shared

    def _tiers(self, keys: Sequence[bytes], missing: str = "") -> list[str]:
        """The tier below holding each of ``keys`` (``missing`` for none)."""
        out = self.policy.lookup(keys)
        if len(out) < len(keys):
            holds = self.policy.holds
            out += [holds(k) or missing for k in keys[len(out):]]
        return out

    def worth_fetching(self, st: RequestState, first: int, start: int, held: int) -> int:
        """How many of the ``held`` blocks the shared tier holds after the local prefix
        ``[first:start]`` are worth fetching and loading rather than computing, as a local
        hit's are (:meth:`worth_loading`, over every group's blocks a hit up to them needs);
        counted as the shared tier's decisions (the local prefix's are counted when the
        request is admitted). Called once per probe of the shared tier."""
        if self.costs is None or not self.costs.deciding or held <= 0:
            return held
        tiers, shared = self._hit_tiers(st, first, start + held, start)
        positions, entries = self._cut(tiers, first, start + held - first)
        self.costs.count([self.costs.fetched or ""] * shared, max(0, entries - (len(tiers) - shared)))
        return max(0, positions - (start - first))

    def stored(self, st: RequestState, g: int, i: int) -> bool:
        """Do the tiers below keep block ``i`` of ``st`` in group ``g`` (:meth:`KVGroups.stored`
        at the ends its last lookup found)?"""
        return self.groups.stored(g, i, st.ends)

    def all_group_keys(self, st: RequestState, lo: int, hi: int) -> list[bytes]:
        """Every group's key of blocks ``lo..hi``, block by block (what the remote tier is
        probed for: :meth:`probed` reads the answer)."""
        return self.groups.interleave([st.keys_of(g, lo, hi) for g in range(len(self.groups))])

    def probed(self, answer: Any, start: int, last: int, st: RequestState | None = None) -> int:
        """Blocks from ``start`` a hit can take from the remote tier, from its answer to a probe
        of :meth:`all_group_keys`: how many leading keys it holds, or whether it holds each
        (the longest hit every group can then serve; ``st``: how far its full-attention
        prefix reaches in the remote tier and the local ones together is noted)."""
        width = len(self.groups)
        if isinstance(answer, int):  # the leading keys: block i of group g is the ((i - start) * width + g)th
            lead = answer

            def shared_holds(g: int, i: int) -> bool:
                return (i - start) * width + g < lead

            def run(g: int, lo: int, hi: int) -> int:
                return max(0, min(hi, start - (g - lead) // width) - lo)
        else:
            if len(answer) != width * (last - start):
                return 0

            def shared_holds(g: int, i: int) -> bool:
                return bool(answer[(i - start) * width + g])

            run = None  # type: ignore[assignment]
        if st is not None:
            holds = self.policy.holds
            self._reached(st, last, self.groups.full_end(
                start, last, lambda g, i: shared_holds(g, i) or holds(st.group_key(g, i)) is not None))
        return self.groups.hit_end(start, last, shared_holds, run) - start

    def plan_fetch(self, st: RequestState, first: int, start: int, held: int) -> FetchPlan | None:
        """The remote tier holds ``held`` blocks from ``st.hashes[start]`` on, after the local
        prefix ``[first:start]``: touch that prefix (the fetch's placements must not evict it)
        and plan fetching them into CPU slots (what each group needs for a hit at
        ``start + held``, block by block). None when nothing can be fetched."""
        if held <= 0 or not self.shared:
            return None
        end = start + held
        self.policy.touch(self.all_group_keys(st, first, start))
        needed = self.groups.entries(start, end)
        keys = [st.group_key(g, i) for i in range(start, end) for g, lo in needed if i >= lo]
        plan = self.policy.prepare_fetch(keys, st.req_id)
        if not len(plan):
            self.policy.complete_fetch(plan, 0)
            return None
        st.fetch = plan
        self._fetching[plan.plan_id] = (plan, st)
        self._planned.append(plan)
        return plan

    def fetch_done(self, plan_id: int, fetched: int) -> FetchPlan | None:
        """Executors fetched the first ``fetched`` blocks of a fetch plan: those are held in
        the CPU tier from now on, remote hits of the request they were fetched for."""
        entry = self._fetching.pop(plan_id, None)
        if entry is None:
            return None
        plan, st = entry
        self.policy.complete_fetch(plan, fetched)
        st.fetch = None
        st.fetched = set(plan.keys[:fetched])
        return plan

    def lookup_now(self, st: RequestState, executor: "Executor", first: int, last: int) -> int:
        """Synchronous drivers: :meth:`held_below`, after fetching what the remote tier holds
        right after the local prefix (probed, fetched and completed at once), cut to what is
        worth loading (:meth:`worth_fetching`, :meth:`worth_loading`), as the scheduler half."""
        held = self.held_below(st, first, last)
        start = first + held
        if self.shared and start < last:
            plan = self.probe_answered(st, first, start, executor.probe(self.all_group_keys(st, start, last)),
                                       start, last)
            if plan is not None:
                self._planned.remove(plan)
                fetched = executor.fetch(plan)
                self.complete(fetches=[(plan.plan_id, fetched)])
                held = self.held_below(st, first, last) if fetched else held
        return self.worth_loading(st, first, held)

    def probe_answered(self, st: RequestState, first: int, start: int, answer: Any, begin: int,
                       end: int) -> FetchPlan | None:
        """The remote tier answered a probe of :meth:`all_group_keys` ``(st, begin, end)``; the
        tiers below hold ``[first:start]`` now (an asynchronous probe's local prefix may have
        changed since it was sent). Plans fetching what the remote tier holds right after that
        prefix and is worth fetching (:meth:`probed`, :meth:`worth_fetching`,
        :meth:`plan_fetch`); None when nothing is. The one rule for a synchronous driver
        (:meth:`lookup_now`) and a probe answered later (the vLLM scheduler's)."""
        held = self.probed(answer, begin, end, st)
        held = begin + held - start if start >= begin else 0
        return self.plan_fetch(st, first, start, self.worth_fetching(st, first, start, held))

    # ------------------------------------------------------------------ loads

    def admit(self, st: RequestState, gpu_hits: int, block_ids: Sequence[Any], num_external: int,
              num_tokens: int, resumed: bool = False) -> LoadPlan | None:
        """The driver's pool allocated the request (``block_ids``: a block table per group):
        ``gpu_hits`` blocks from its own prefix cache, then ``num_external`` blocks to load
        from below. Touches the device hits in every tier below (before the load's
        promotions, whose cascades may evict), counts the lookup and plans the load."""
        st.resumed, st.gpu_hits = resumed, gpu_hits
        if st.decision is not None and self.costs is not None:
            tiers, loaded = st.decision
            self.costs.count(tiers, loaded if num_external else 0)
        st.decision = None
        st.hits = request_counts(gpu_hits, [], self.tiers)
        st.load, st.load_lost, st.sources = None, set(), []
        self.policy.touch(self.all_group_keys(st, 0, gpu_hits))
        counts = self.resumed if resumed else self.counts
        counts.query(-(-num_tokens // self.block_size), num_tokens)
        counts.add(GPU, gpu_hits)
        fetched, st.fetched = st.fetched, set()
        if not num_external:
            return None
        end = gpu_hits + num_external
        entries = self.groups.blocks(gpu_hits, end, block_ids)
        plan = self.policy.prepare_load(st.req_id, [st.group_key(g, i) for i, g, _ in entries],
                                        [b for _, _, b in entries])
        st.sources = self.groups.position_tiers(gpu_hits, end, [i for i, _, _ in entries],
                                                served_from(plan.tiers(), plan.keys, fetched, slab=plan.slab,
                                                            shared=self.policy.shared_tier), self.tiers)
        st.load = plan
        self._planned.append(plan)
        return plan

    def take_planned(self) -> list[LoadPlan | FetchPlan]:
        """The loads and fetches prepared since the last call, in preparation order (the order
        executors run them in); from now on they are running."""
        out, self._planned = self._planned, []
        for plan in out:
            if isinstance(plan, LoadPlan):
                self._loading[plan.req_id] = self.requests[plan.req_id]
        return out

    def loading(self, req_id: str) -> RequestState | None:
        """The state of a request whose load is running (also once the request finished)."""
        return self._loading.get(req_id)

    def load_finished(self, req_id: str, delivered: int | None = None) -> tuple[RequestState, LoadPlan, int] | None:
        """Executors finished the running load of ``req_id`` (``load_lost``: what they could not
        read; ``delivered``: entries they copied in, when they say, e.g. of a load cut at its
        deadline). Returns its state, the plan and how many block positions arrived (hits,
        counted; ``len(st.sources)`` were planned)."""
        st = self._loading.pop(req_id, None)
        if st is None or st.load is None:
            return None
        plan = st.load
        return st, plan, self._complete_load(st, st.load_lost, delivered)

    def arrived(self, plan: LoadPlan, loaded: int) -> int:
        """Entries of ``plan`` in the device pool once ``loaded`` positions arrived
        (:meth:`KVGroups.arrived`)."""
        return self.groups.arrived(loaded, len(plan))

    def _complete_load(self, st: RequestState, lost: Lost, loaded: int | None = None) -> int:
        plan = st.load
        assert plan is not None
        lost = list(lost)
        n = plan.loaded(lost) if loaded is None else loaded
        self.policy.complete_load(plan, lost, n)
        n = self.groups.served(n, len(plan), len(st.sources))  # the positions of a hit every group serves
        counts = self.resumed if st.resumed else self.counts
        for tier in st.sources[:n]:
            counts.add(tier, 1)
            st.hits[tier] += 1
        st.load, st.load_lost = None, set()
        return n

    # ------------------------------------------------------------------ stores

    def end_step(self, evicted: Blocks, computed: Blocks,
                 window: Callable[[int], Blocks] | None = None) -> tuple[list[StorePlan], list[StorePlan]]:
        """The step's store offers, in the one order: blocks the pool evicted (``early``: their
        copies run before the step's loads and forward rewrite the rows), blocks computed
        (``late``), then the page-out window (``window(n)``: the pool's ``n`` least recently
        used free blocks). Plans with nothing to do complete at once."""
        self.gpu_evictions += len(evicted)
        early = self._offer(evicted, EVICTED)
        late = self._offer(computed, COMPUTED)
        if window is not None and self.policy.pageout_blocks:
            late += self._offer(window(self.policy.pageout_blocks), PAGEOUT)
        return early, late

    def _offer(self, blocks: Blocks, reason: str) -> list[StorePlan]:
        if not blocks or not self.policy.admits(reason):
            return []
        plan = self.policy.prepare_store([b for b, _ in blocks], [k for _, k in blocks], reason)
        if reason == EVICTED:
            self.stored_at_eviction += len(plan)
        if plan.empty:
            self.policy.complete_store(plan)
            return []
        self._storing[plan.plan_id] = plan
        return [plan]

    def shutdown(self, executor: "Executor", resident_mru_first: Blocks) -> StorePlan:
        """A graceful close: offer the device-resident blocks (most recently used first) as
        ``shutdown`` (the hot set the persistent tier lacks goes there) and run the plan."""
        plan = self.policy.prepare_store([b for b, _ in resident_mru_first], [k for _, k in resident_mru_first],
                                         SHUTDOWN)
        self.policy.complete_store(plan, executor.store(plan) if not plan.empty else [])
        return plan

    def store_done(self, plan_id: int, lost: Lost = ()) -> StorePlan | None:
        """Executors finished a store plan; ``lost``: ``(tier, key)`` they could not write."""
        plan = self._storing.pop(plan_id, None)
        if plan is not None:
            self.policy.complete_store(plan, lost)
        return plan

    # ------------------------------------------------------------------ synchronous drivers

    def complete(self, stores: Iterable[tuple[int, Lost]] = (), fetches: Iterable[tuple[int, int]] = (),
                 loads: Iterable[tuple[str, int | None]] = (), lost: Lost = ()) -> Completed:
        """Executors finished these plans: complete them in the one order every driver keeps.
        ``stores`` (plan id, the ``(tier, key)`` pairs it could not write) first, then ``lost``
        (pairs no plan is named for: a vLLM step's, every worker's together) is forgotten,
        then ``fetches`` (plan id, blocks fetched), then the running ``loads`` (request id,
        entries delivered; None: all but its ``load_lost``), which may read what came before."""
        done = Completed([p for pid, failed in stores if (p := self.store_done(pid, failed)) is not None], [])
        self.policy.forget_pairs(lost)
        done.fetches = [(p, n) for pid, n in fetches if (p := self.fetch_done(pid, n)) is not None]
        done.loads = [f for rid, n in loads if (f := self.load_finished(rid, n)) is not None]
        return done

    def run(self, executor: "Executor", stores: Sequence[StorePlan], st: RequestState | None = None) -> "LoadResult":
        """Synchronous drivers: run ``stores``, then the planned load of ``st`` (if any), on
        ``executor``; then :meth:`complete` them. Returns the load's result, its ``loaded``
        the positions of the hit it served (:meth:`KVGroups.served`: with groups, all of them
        or none, however many entries each position took)."""
        from kvstrata.dataplane.executor import LoadResult

        lost = [executor.store(plan) for plan in stores]
        plan = st.load if st is not None else None
        result = LoadResult(0)
        if plan is not None:
            assert st is not None
            self._planned.remove(plan)
            self._loading[st.req_id] = st
            result = executor.load(plan)
            st.load_lost.update(result.lost)
        done = self.complete(zip((p.plan_id for p in stores), lost),
                             loads=[(st.req_id, result.loaded)] if plan is not None and st is not None else ())
        if done.loads:
            result.loaded = done.loads[0][2]
        return result

    # ------------------------------------------------------------------ statistics

    def no_hits(self) -> dict[str, int]:
        """A request's counts when nothing served it (one rejected before its lookup)."""
        return request_counts(0, [], self.tiers)

    def stats(self) -> dict[str, Any]:
        """``queries`` and ``hits`` of new requests, and the same under ``preempted``."""
        return {**self.counts.stats(self.block_size), "preempted": self.resumed.stats(self.block_size)}
