"""Replay a trace through the deployed placement: kvstrata's pool, the tier policy, an executor.

The replay drives the same :class:`~kvstrata.policy.TierPolicy` as the library
and the vLLM connector, in the order the connector drives it under vLLM's
scheduler, so its hit counts are what a deployment of the same config sees:

* a request whose prefix is partly held below takes two steps, as in vLLM:
  step A allocates its cached prefix and the blocks to load (the load is
  planned, sources pinned), step B the rest of the prompt (computed): in the
  chunks vLLM's scheduler would step it in (``gpu.max_num_batched_tokens``
  tokens a step; with state groups, where states are cached), a step each;
* every step ends the same way: blocks the pool evicted in the step are
  offered as ``evicted``, newly computed blocks as ``computed``, the page-out
  window as ``pageout``; then the step's stores complete, then its loads.

The GPU pool is a :class:`~kvstrata.pool.blocks.BlockManager`, which evicts and
frees in vLLM's order. With one request at a time this is exactly what the
connector does under vLLM (a test checks it against the real scheduler);
with concurrent requests vLLM interleaves steps of different requests,
which the replay approximates by running each arrival's steps back to back.

Hash-id traces (Mooncake, Qwen-Bailian): every id is a full block that may
hit (no last-token cap). Request lifetimes: a request holds its GPU blocks
from arrival until ``arrival + output_length * decode_s_per_token``
(prefill time and the output tokens' own blocks are not modelled). When the
GPU pool has too few free blocks for an arrival, running requests are
finished early, earliest finisher first, and counted as ``forced_frees``. A
request that needs more blocks than the whole pool is rejected, as an engine
rejects it: counted (``rejected``), with the pool size that would admit it.

Capacities: the trace's block size replaces the config's ``block_size``;
tier capacities keep their meaning in tokens and bytes (``gpu.num_blocks``
is converted to the same number of tokens). Without payload no bytes move
(a null executor); ``payload=True`` moves real bytes (``payload_block_bytes``
per block) through a host pool, the CPU slab and an SSD tier in a temporary
directory, with the tiers holding the same number of blocks.

Memory: the replay reads each request once and keeps nothing per request
(unless ``record_requests``) or per access. Per block it keeps a state byte
and two times (miss reasons, whole-cache lifetimes), in arrays indexed by
the trace's dense block ids, so its memory follows the trace's distinct
blocks; the pool and the tiers hold what their capacities hold. Lifecycle
samples are summarised as they come (:mod:`kvstrata.bench.lifelog`,
:class:`~kvstrata.bench.stats.Quantiles`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import tempfile
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from kvstrata.pool.blocks import Prompt
from kvstrata.pool.protocol import stepped_pool
from kvstrata.identity.groups import KVGroups, parse_groups
from kvstrata.config.schema import KVStrataConfig
from kvstrata.errors import ConfigError, OutOfBlocksError
from kvstrata.dataplane.executor import Executor, NullExecutor
from kvstrata.bench.lifelog import LifecycleLog
from kvstrata.bench.replay_result import ReplayError, ReplayOptions, ReplayResult
from kvstrata.bench.budget import check_memory
from kvstrata.bench.capacity import config_for_trace, policy_spec, tier_capacities
from kvstrata.bench.payload import payload_config, payload_executor
from kvstrata.bench.misses import MISS_REASONS, Tracker, miss_reasons
from kvstrata.core.metrics import TIERS, LifecycleRecorder, policy_stats
from kvstrata.policy import TierPolicy
from kvstrata.bench.remote import SharedTierExecutor, SharedTierModel, models_shared, shared_capacity_blocks
from kvstrata.bench.stats import Quantiles
from kvstrata.core.costs import fixed_costs
from kvstrata.core.driver import DriverCore
from kvstrata.core.request import RequestState
from kvstrata.policy.positions import prefix_weight
from kvstrata.policy.tiers import GPU

if TYPE_CHECKING:
    from kvstrata.trace.reader import Request, Trace, TraceReader

__all__ = ["TIERS", "MISS_REASONS", "ReplayError", "ReplayOptions", "ReplayResult", "Replayer", "config_for_trace",
           "tier_capacities", "policy_spec", "replay", "replaying", "requests_of"]


class Replayer:
    """One pass over a trace, a request at a time (see the module docstring for the step protocol).

    Made by :func:`replaying`, which sets :attr:`result` when it exits."""

    def __init__(self, block_size: int, cfg: KVStrataConfig, opts: ReplayOptions, executor: Executor,
                 shared: SharedTierModel | None = None) -> None:
        self.block_size, self.opts = block_size, opts
        self.now = 0.0
        self.spec = policy_spec(cfg)
        self.shared = shared  # the shared tier of several replicas (kvstrata.bench.replicas)
        assert self.spec.tiers is not None
        if bool(self.spec.tiers.shared) != (shared is not None):  # a shared tier is replayed only when modelled
            tiers = self.spec.tiers.with_shared("the replay's model" if shared is not None else None)
            self.spec = dataclasses.replace(self.spec, tiers=tiers)
        self._left: list[tuple[list[bytes], str]] = []
        self.gpu_blocks = cfg.gpu.resolve_num_blocks(cfg.block_nbytes())
        self.groups = KVGroups(parse_groups(cfg.model.groups, "model.groups"), block_size,
                               cfg.model.retention_interval)
        self.budget = cfg.gpu.max_num_batched_tokens  # the engine's tokens per step: a prefill's chunks
        self.manager = stepped_pool(self.gpu_blocks, self.groups, budget=self.budget)
        below: dict[str, LifecycleLog] = {}  # filled once the policy names its tiers
        self.policy = TierPolicy(self.spec, clock=lambda: self.now,
                                 observers=[LifecycleRecorder(below), self._observe])
        #: the tiers this replica holds blocks in, as statistics name them: the device, then the policy's
        self.tiers: tuple[str, ...] = (GPU, *self.policy.lower_tiers)
        self.lifecycle = {t: LifecycleLog() for t in self.tiers}
        below.update({t: self.lifecycle[t] for t in self.policy.lower_tiers})
        self.tracker = Tracker(self.tiers)
        self.executor = SharedTierExecutor(shared) if shared is not None else executor
        self.costs = fixed_costs(cfg.load, self.spec, cfg.block_nbytes(), opts.load_policy)
        self.core = DriverCore(self.policy, block_size, self.groups, self.costs)
        self.ttft = Quantiles() if self.costs is not None else None
        self.ttft_total = 0.0
        self.running: list[tuple[float, int]] = []
        # recorded preemptions still to replay: (time, order, request, tokens; 0 = preempted)
        self.preempting: list[tuple[float, int, int, int]] = []
        self._order = itertools.count()
        self.resumable: dict[int, Prompt] = {}  # running requests with preemptions to replay
        self.reasons = dict.fromkeys(miss_reasons(self.tiers), 0)
        self.forced = self.peak = self.rejected = self.rejected_max = 0
        self.request_hits: list[dict[str, int]] | None = [] if opts.record_requests else None
        self.requests = self.accesses = self.prompt_tokens = 0
        self.compute_saved = 0.0  # the hits' compute, in blocks without context (kvstrata.policy.positions)
        self.misses: list[dict[str, Any]] | None = [] if opts.explain else None
        self.wall_s = 0.0
        self.result: ReplayResult | None = None

    def _observe(self, kind: str, tier: str, keys: Any, now: float) -> None:
        if kind in ("evicted", "lost", "dropped"):
            self._left.append((list(keys), tier))

    # ------------------------------------------------------------------ requests

    def finish_until(self, now: float) -> None:
        """Free the requests finished by ``now`` and replay the preemptions due by then (a
        preemption frees the request's blocks, its resumption looks it up again); then a
        step with nothing scheduled runs (as in vLLM, the step that tells the workers): the
        page-out window is offered."""
        running, preempting, manager = self.running, self.preempting, self.manager
        freed = False
        while running or preempting:
            fin = running[0][0] if running else float("inf")
            due = preempting[0][0] if preempting else float("inf")
            if min(fin, due) > now:
                break
            if preempting and due <= fin:
                at, _, rid, tokens = heapq.heappop(preempting)
                self.now = max(self.now, at)
                freed |= self._preempted(rid, tokens)
                continue
            fin, rid = heapq.heappop(running)
            self.now = max(self.now, fin)
            if str(rid) in manager.requests:  # else preempted, and not resumed before it finished
                manager.free(str(rid))
                freed = True
            self.resumable.pop(rid, None)
        if freed and self.policy.pageout_blocks:
            self._end_step([])

    def _preempted(self, rid: int, tokens: int) -> bool:
        """Request ``rid`` preempted (``tokens`` 0: its blocks are freed) or resumed (its
        first ``tokens`` looked up again, the rest computed); True when blocks were freed."""
        prompt = self.resumable.get(rid)
        if prompt is None:
            return False  # finished early to make room for another
        held = str(rid) in self.manager.requests
        if not tokens:
            if held:
                self.manager.free(str(rid))
            return held
        if not held:
            cap = min(len(prompt.hashes), max(tokens - 1, 0) // self.block_size)
            self._schedule(str(rid), Prompt(prompt.hashes, prompt.num_tokens, cap), resumed=True)
        return False

    def _room(self, call: Callable[[], Any]) -> Any:
        """``call()``, finishing running requests early while the pool is too full for it."""
        while True:
            try:
                return call()
            except OutOfBlocksError:
                victim = self._first_to_finish()
                if victim is None:
                    raise
                self.manager.free(str(victim))
                self.resumable.pop(victim, None)
                self.forced += 1

    def _first_to_finish(self) -> int | None:
        """Take out of ``running`` the request that finishes first among those holding blocks
        (a preempted one, or one being resumed, holds none and stays)."""
        skipped = []
        victim = None
        while self.running:
            entry = heapq.heappop(self.running)
            if str(entry[1]) in self.manager.requests:
                victim = entry[1]
                break
            skipped.append(entry)
        for entry in skipped:
            heapq.heappush(self.running, entry)
        return victim

    def step(self, r: "Request") -> None:
        """Replay the next request (arrival order)."""
        t0 = time.perf_counter()
        rid = self.requests
        self.requests += 1
        self.accesses += len(r.blocks)
        self.prompt_tokens += r.input_length if r.token_based else len(r.blocks) * self.block_size
        if r.blocks or r.output_blocks:
            self.tracker.cover(max([*r.blocks, *r.output_blocks]) + 1)
        self._step(rid, r)
        self.wall_s += time.perf_counter() - t0

    def _step(self, rid: int, r: "Request") -> None:
        self.policy.forget_pairs(self.executor.take_lost())  # what the SSD tier dropped on its own
        self.finish_until(r.timestamp)
        self.now = max(self.now, r.timestamp)
        prompt = self.prompt_of(r)
        needed = self.manager.blocks_needed(prompt)
        if needed > self.gpu_blocks:
            self.rejected += 1
            self.rejected_max = max(self.rejected_max, needed)
            self.reasons["rejected"] += len(r.blocks)
            if self.request_hits is not None:
                self.request_hits.append(self.core.no_hits())
            if self.misses is not None:
                self.misses.append(self._miss(r, rid, 0, "rejected"))
            return
        before = bytes(map(self.tracker.state.__getitem__, r.blocks))
        prefill = r.input_length if r.token_based else len(r.blocks) * self.block_size
        hits = self._schedule(str(rid), prompt, prefill=prefill)
        self.compute_saved += prefix_weight(hits, self.spec.attention_share, self.block_size)
        self.tracker.classify(before, hits, r.hittable, self.reasons)
        if self.misses is not None and hits < r.hittable:
            self.misses.append(self._miss(r, rid, hits, self.tracker.first_reason(before, hits)))
        self.tracker.touch([*r.blocks, *r.output_blocks], self.now)
        if r.output_length > 1:
            self._decode(str(rid))
        held = r.duration if r.duration >= 0 else r.output_length * self.opts.decode_s_per_token
        heapq.heappush(self.running, (r.timestamp + held, rid))
        if r.preemptions:
            self.resumable[rid] = prompt
            for preempted, resumed, tokens in r.preemptions:
                heapq.heappush(self.preempting, (r.timestamp + preempted, next(self._order), rid, 0))
                heapq.heappush(self.preempting, (r.timestamp + resumed, next(self._order), rid, max(tokens, 1)))
        self.peak = max(self.peak, len(self.running))

    def _miss(self, r: "Request", rid: int, hit: int, reason: str) -> dict[str, Any]:
        """Why request ``rid``'s block ``hit`` (its first miss) missed, and since when."""
        out: dict[str, Any] = {"request": rid, "line": r.line, "timestamp": r.timestamp, "blocks": len(r.blocks),
                               "hittable": r.hittable, "hit": hit, "first_miss": hit, "reason": reason}
        if reason.startswith("evicted_"):
            block = r.blocks[hit]
            out["left_s_ago"] = self.now - self.tracker.left[block]
            out["last_used_s_ago"] = self.now - self.tracker.last[block]
        return out

    def prompt_of(self, r: "Request") -> Prompt:
        """The request as the pool sees it; a recorded request with the full blocks its output
        completed: they are allocated and computed with its prompt (never looked up)."""
        n_tokens = r.input_length if r.token_based else len(r.blocks) * self.block_size
        if r.output_blocks:
            keys = [b.to_bytes(8, "little") for b in (*r.blocks, *r.output_blocks)]
            kv_tokens = max(n_tokens, r.input_length + r.output_length - 1)  # the last token's KV is never computed
            return Prompt(keys, max(kv_tokens, len(keys) * self.block_size), r.hittable)
        return Prompt([b.to_bytes(8, "little") for b in r.blocks], n_tokens, r.hittable)

    def held_prefix(self, prompt: Prompt) -> int:
        """Blocks of ``prompt``'s prefix this replica holds, in its pool or below (what a
        prefix-aware router reads from its KV-cache events). Pure."""
        st = RequestState("", prompt.hashes)
        gpu = self.manager.lookup(prompt, self._key(st))
        return gpu + self.core.held_below(st, gpu, prompt.cap, note=False)

    def _schedule(self, rid: str, prompt: Prompt, resumed: bool = False, prefill: int | None = None) -> int:
        """Steps A (prefix + loads) and B (the rest, computed); returns the blocks served from
        cache. ``resumed``: a preempted request looked up again, counted apart."""
        manager, core = self.manager, self.core
        st = RequestState(rid, prompt.hashes)
        key = self._key(st)
        gpu_hits = manager.lookup(prompt, key)
        below = core.lookup_now(st, self.executor, gpu_hits, prompt.cap)
        stored = lambda g, i: core.stored(st, g, i)  # noqa: E731
        # the pool holds the blocks of the prefill's first chunk (after a load: those to load first)
        extra = {"num_external": below, "num_blocks": gpu_hits + below} if below else {}
        alloc = self._room(lambda: manager.allocate(rid, prompt=prompt, key=key, prefill=prefill, stored=stored,
                                                    **extra))
        core.admit(st, gpu_hits, alloc.tables, below, prompt.num_tokens, resumed)
        self._gpu_hits(core.all_group_keys(st, 0, gpu_hits))
        loaded = 0
        if below:
            loaded = self._end_step([], st)
            if loaded < below:
                manager.invalidate(rid, gpu_hits + loaded)
            self.lifecycle[GPU].enter_many([k for i, _, k in alloc.external if i < gpu_hits + loaded], self.now)
            self._room(lambda: manager.grow(rid))
        self._commit(rid)
        while self._room(lambda: manager.advance(rid)):  # the prefill's later chunks, a step each
            self._commit(rid)
        if self.request_hits is not None and not resumed:
            self.request_hits.append(st.hits)
        if self.ttft is not None and not resumed:
            ttft = self._ttft(st, prompt.num_tokens - (gpu_hits + loaded) * self.block_size)
            self.ttft.add([ttft])
            self.ttft_total += ttft
        return gpu_hits + loaded

    def _commit(self, rid: str) -> None:
        """End a step of ``rid``'s prefill: what it computed is registered and offered below."""
        computed = self.manager.commit(rid)
        self._note_computed(computed)
        self._end_step(computed)

    def _ttft(self, st: RequestState, computed_tokens: int) -> float:
        """What the figures of ``load.*`` make of a request's TTFT alone on the engine: its
        loads, block by block from each tier (and each tier's latency once), then its computed
        tokens."""
        assert self.costs is not None and self.costs.fixed_token is not None
        return self.costs.load_seconds({t: n for t, n in st.hits.items() if t != GPU}) + \
            max(0, computed_tokens) * self.costs.fixed_token

    def _decode(self, rid: str) -> None:
        """The decode steps that change the pool, each a step of its own (with windows: those of
        a recording's output, else the first; none for one full-attention group)."""
        manager = self.manager
        if rid not in manager.requests:
            return
        for t in manager.decode_steps(rid):
            computed = self._room(lambda: manager.decode(rid, t))  # noqa: B023 (called at once)
            self._note_computed(computed)
            self._end_step(computed)

    def _key(self, st: RequestState) -> Callable[[int, int], bytes]:
        """Group ``g``'s key of ``st``'s block ``i`` (the core's, cached in ``st``)."""
        return st.group_key

    def _end_step(self, computed: list[tuple[int, bytes]], st: RequestState | None = None) -> int:
        """End a step: its store offers and the load of ``st``, run and completed at once."""
        evicted = self.manager.take_evicted()
        if evicted:
            self.lifecycle[GPU].leave_many([h for _, h in evicted], self.now)
        early, late = self.core.end_step(evicted, computed, self.manager.free_window)
        result = self.core.run(self.executor, early + late, st)
        self._settle([h for _, h in evicted])
        return result.loaded

    # ------------------------------------------------------------------ accounting

    def _gpu_hits(self, keys: list[bytes]) -> None:
        self.lifecycle[GPU].access_many(keys, self.now)

    def _note_computed(self, computed: list[tuple[int, bytes]]) -> None:
        """Computed blocks the pool registered enter it (a duplicate of a cached block does not)."""
        blocks = self.manager.blocks
        self.lifecycle[GPU].enter_many([k for b, k in computed if blocks[b].block_hash == k], self.now)

    def _settle(self, gpu_evicted: list[bytes]) -> None:
        """Blocks that left a tier in this step and are held nowhere now have left the cache."""
        left, self._left = self._left, []
        held = self.policy.holds
        cached, now = self.manager.cached, self.now
        leave = self.tracker.left_many
        top, named = len(self.tracker.state), int.from_bytes
        for keys, tier in [*left, (gpu_evicted, GPU)]:  # a lower tier first: it held the block last
            # the tracker follows a position by its chain key (group 0's, a trace's block id): other
            # groups' keys are hashes (1 in 2**64/top names a block)
            gone = [k for k in keys if k not in cached and held(k) is None and named(k, "little") < top]
            if gone:
                leave(gone, tier, now)

    def close(self) -> dict[str, Any]:
        self.finish_until(float("inf"))
        self.tracker.flush()
        stats = {**policy_stats(self.policy, gpu_evictions=self.core.gpu_evictions,
                                gpu_cached=self.manager.num_cached_blocks, gpu_blocks=self.gpu_blocks),
                 "spills_at_eviction": self.core.stored_at_eviction,
                 "executor": self.executor.stats(),
                 "lifecycle": {t: lc.samples() for t, lc in self.lifecycle.items()}}
        device = getattr(self.executor.device, "engine", None)
        stats["transfer"] = {d: dict(v) for d, v in device.moved.items()} if device is not None else {}
        return stats


def _checked(config: KVStrataConfig, block_size: int, admission: str | None) -> tuple[KVStrataConfig, dict[str, int]]:
    try:
        cfg = config_for_trace(config, block_size, admission)
        caps = tier_capacities(cfg)
    except ConfigError as exc:
        raise ReplayError(str(exc)) from None
    return cfg, caps


@contextlib.contextmanager
def replaying(config: KVStrataConfig, block_size: int, options: ReplayOptions = ReplayOptions(),
              shared: SharedTierModel | None = None) -> Iterator[Replayer]:
    """A :class:`Replayer` of ``config`` for a trace of ``block_size``-token blocks: call its
    ``step`` with each request in arrival order; on exit its ``result`` holds the
    :class:`ReplayResult` (the payload tiers, if any, are closed and removed). ``shared``:
    the shared tier this replica stores to and fetches from (no bytes: not with payload);
    by default one of ``remote.capacity`` when ``remote.url`` and ``remote.capacity`` are set."""
    cfg, caps = _checked(config, block_size, options.admission)
    if shared is None and models_shared(cfg):
        try:
            shared = SharedTierModel(shared_capacity_blocks(cfg))
        except ConfigError as exc:
            raise ReplayError(str(exc)) from None
    if shared is not None and options.payload:
        raise ReplayError("--payload: a replay with a shared remote tier moves no bytes")
    try:
        check_memory(caps, options.payload_block_bytes if options.payload else None, options.max_memory,
                     cfg.model.num_groups)
    except ConfigError as exc:
        raise ReplayError(str(exc)) from None
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-") as tmp:
        run_cfg = payload_config(cfg, options.payload_block_bytes, tmp) if options.payload else cfg
        try:
            executor = payload_executor(run_cfg) if options.payload else NullExecutor()
        except (MemoryError, RuntimeError) as exc:  # torch reports a failed allocation as RuntimeError
            raise ReplayError(f"--payload: cannot allocate the tiers' bytes ({str(exc).splitlines()[0][:200]}); "
                              f"lower --payload-block-bytes or the capacities") from None
        rp = Replayer(block_size, run_cfg, options, executor, shared)
        if shared is not None:  # its blocks, under the name the replica's policy gives it
            caps = {**caps, rp.policy.shared_tier: shared.capacity}
        try:
            yield rp
        finally:
            t0 = time.perf_counter()
            stats = rp.close()
            if executor.persistent is not None:
                executor.persistent.close()
            rp.wall_s += time.perf_counter() - t0
            rp.result = _result(rp, config, cfg, caps, stats)


def _result(rp: Replayer, config: KVStrataConfig, cfg: KVStrataConfig, caps: dict[str, int],
            stats: dict[str, Any]) -> ReplayResult:
    opts = rp.opts
    return ReplayResult(cfg, rp.spec, caps, rp.requests, rp.accesses, rp.core.counts.hits, rp.reasons,
                        rp.forced, rp.peak, rp.wall_s, stats, rp.rejected, rp.rejected_max,
                        _admit_hint(config, rp.rejected_max * rp.block_size) if rp.rejected else None,
                        rp.request_hits or [], rp.tracker.lifetime, rp.tracker.idle,
                        opts.payload_block_bytes if opts.payload else None, config.block_size,
                        rp.prompt_tokens, rp.misses or [], rp.core.resumed.hits, rp.ttft,
                        None if rp.costs is None else {**rp.costs.estimates(), "decisions": rp.costs.decisions,
                                                       "mean_ttft_s": rp.ttft_total / max(1, rp.requests)},
                        rp.compute_saved, rp.tiers)


def requests_of(trace: "Trace | TraceReader | Iterable[Request]") -> Iterator["Request"]:
    """The requests of an in-memory trace, or of a reader as it reads them."""
    from kvstrata.trace.reader import Trace

    return iter(trace.requests if isinstance(trace, Trace) else trace)


def replay(trace: "Trace | TraceReader", config: KVStrataConfig, options: ReplayOptions = ReplayOptions(),
           progress: Callable[[int], None] | None = None) -> ReplayResult:
    """Drive ``trace`` through the tier policy of ``config`` (see the module docstring).

    A :class:`~kvstrata.trace.reader.TraceReader` is replayed as it is read."""
    requests = requests_of(trace)
    first = next(requests, None)
    with replaying(config, trace.block_size, options) as rp:
        for n, r in enumerate(itertools.chain(() if first is None else (first,), requests), 1):
            rp.step(r)
            if progress is not None and n & 255 == 0:
                progress(n)
    assert rp.result is not None
    return rp.result


def _admit_hint(original: KVStrataConfig, tokens: int) -> str:
    """The ``--set`` that gives the GPU pool room for ``tokens`` (in the config's own units)."""
    if original.gpu.num_blocks is not None:
        return f"--set gpu.num_blocks={-(-tokens // original.block_size)} or more for concurrent requests"
    need = int(tokens * original.block_nbytes() / original.block_size)
    return f"--set gpu.capacity={-(-need // 1024**3)}GiB or more"
