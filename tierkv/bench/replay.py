"""Replay a trace through the deployed placement: tierkv's pool, the tier policy, an executor.

The replay drives the same :class:`~tierkv.policy.TierPolicy` as the library
and the vLLM connector, in the order the connector drives it under vLLM's
scheduler, so its hit counts are what a deployment of the same config sees:

* a request whose prefix is partly held below takes two steps, as in vLLM:
  step A allocates its cached prefix and the blocks to load (the load is
  planned, sources pinned), step B the rest of the prompt (computed);
* every step ends the same way: blocks the pool evicted in the step are
  offered as ``evicted``, newly computed blocks as ``computed``, the page-out
  window as ``pageout``; then the step's stores complete, then its loads.

The GPU pool is a :class:`~tierkv.block_pool.BlockManager`, which evicts and
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
"""

from __future__ import annotations

import dataclasses
import heapq
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from tierkv.block_pool import BlockManager, Prompt
from tierkv.config import TierKVConfig
from tierkv.errors import ConfigError, OutOfBlocksError
from tierkv.executor import Executor, NullExecutor
from tierkv.bench.lifelog import LifecycleLog
from tierkv.metrics import LifecycleRecorder, policy_stats
from tierkv.policy import COMPUTED, EVICTED, PAGEOUT, LoadPlan, PolicySpec, StorePlan, TierPolicy

if TYPE_CHECKING:
    from tierkv.bench.traces import Trace

__all__ = ["TIERS", "MISS_REASONS", "ReplayError", "ReplayOptions", "ReplayResult", "config_for_trace",
           "tier_capacities", "policy_spec", "replay"]

TIERS = ("gpu", "cpu", "ssd")
MISS_REASONS = ("new", "evicted_gpu", "evicted_cpu", "evicted_ssd", "prefix_miss", "last_token", "rejected", "other")

# per-block state while replaying
_NEVER, _CACHED = 0, 1
_LEFT = {"gpu": 2, "cpu": 3, "ssd": 4}
_STATE_REASON = {2: "evicted_gpu", 3: "evicted_cpu", 4: "evicted_ssd"}


class ReplayError(ValueError):
    """The configuration cannot replay this trace."""


@dataclass(frozen=True)
class ReplayOptions:
    """How requests are timed, whether bytes move, and which admission runs."""

    decode_s_per_token: float = 0.02
    payload: bool = False
    payload_block_bytes: int = 16 * 1024
    admission: str | None = None   # None: the config's spill.admission
    record_requests: bool = False  # keep each request's hits per tier (ReplayResult.request_hits)


@dataclass
class ReplayResult:
    """Counts from one replay (block counts are of the trace's block size)."""

    config: TierKVConfig
    spec: PolicySpec
    capacity_blocks: dict[str, int]
    requests: int
    accesses: int
    hit_blocks: dict[str, int]
    miss_reasons: dict[str, int]
    forced_frees: int
    peak_running: int
    wall_s: float
    stats: dict[str, Any]
    rejected: int = 0
    rejected_max_blocks: int = 0
    admit_hint: str | None = None
    request_hits: list[dict[str, int]] = field(default_factory=list)
    cache_lifetime_s: list[float] = field(default_factory=list)
    cache_idle_before_evict_s: list[float] = field(default_factory=list)
    payload_block_bytes: int | None = None

    @property
    def hits(self) -> int:
        return sum(self.hit_blocks.values())

    def hit_rate(self) -> dict[str, float]:
        n = self.accesses or 1
        rates = {t: self.hit_blocks[t] / n for t in TIERS}
        rates["total"] = self.hits / n
        return rates

    def lifecycle(self, tier: str, what: str) -> Any:
        """Raw samples ``what`` (lifetime_s | idle_before_evict_s | reuse_gap_s) of ``tier`` (an array)."""
        import numpy as np

        got = self.stats.get("lifecycle", {}).get(tier, {}).get(what)
        return np.asarray(got if got is not None else [], dtype=np.float64)


def _gpu_tokens(cfg: TierKVConfig) -> int | None:
    return cfg.gpu.num_blocks * cfg.block_size if cfg.gpu.num_blocks is not None else None


def config_for_trace(cfg: TierKVConfig, block_size: int, admission: str | None = None) -> TierKVConfig:
    """``cfg`` with the trace's block size, keeping every capacity in tokens/bytes."""
    model, gpu, spill = cfg.model, cfg.gpu, cfg.spill
    if model.block_nbytes is not None:
        per_token = model.block_nbytes / cfg.block_size
        model = dataclasses.replace(model, block_nbytes=max(1, round(per_token * block_size)))
    tokens = _gpu_tokens(cfg)
    if tokens is not None:
        gpu = dataclasses.replace(gpu, num_blocks=max(1, tokens // block_size))
    if admission is not None and admission != spill.admission:
        promotion = spill.promotion if admission == "on_evict" else "inclusive"
        spill = dataclasses.replace(spill, admission=admission, promotion=promotion)
    return dataclasses.replace(cfg, block_size=block_size, model=model, gpu=gpu, spill=spill)


def policy_spec(cfg: TierKVConfig) -> PolicySpec:
    """The policy a deployment of ``cfg`` runs (blocks of ``cfg.block_nbytes()``)."""
    nbytes = cfg.block_nbytes()
    return PolicySpec.from_config(cfg, block_nbytes=nbytes, gpu_blocks=cfg.gpu.resolve_num_blocks(nbytes))


def tier_capacities(cfg: TierKVConfig) -> dict[str, int]:
    """Blocks each tier holds under ``cfg``."""
    spec = policy_spec(cfg)
    return {"gpu": cfg.gpu.resolve_num_blocks(cfg.block_nbytes()), "cpu": spec.cpu_slots, "ssd": spec.ssd_slots}


class _Tracker:
    """Per-block state for miss reasons and whole-cache lifetimes."""

    def __init__(self, id_bound: int) -> None:
        self.state = bytearray(id_bound)
        self.entered = [0.0] * id_bound
        self.last = [0.0] * id_bound
        self.lifetime: list[float] = []
        self.idle: list[float] = []

    def left_many(self, keys: list[bytes], tier: str, now: float) -> None:
        """These blocks left the last tier that held them (``tier``)."""
        state, code = self.state, _LEFT[tier]
        for key in keys:
            block = _block(key)
            if state[block] == _CACHED:
                state[block] = code
                self.lifetime.append(now - self.entered[block])
                self.idle.append(now - self.last[block])

    def touch(self, blocks: list[int], now: float) -> None:
        state, entered, last = self.state, self.entered, self.last
        for b in blocks:
            if state[b] != _CACHED:
                state[b] = _CACHED
                entered[b] = now
            last[b] = now


def _classify(before: bytes, hit: int, hittable: int, reasons: dict[str, int]) -> None:
    """Why each block after the first ``hit`` missed, from its state before the request
    (``before[j]``): counted per state with ``bytes.count``, no per-block loop."""
    if hittable < len(before):
        reasons["last_token"] += len(before) - max(hit, hittable)
    seg = before[hit:hittable]
    if not seg:
        return
    reasons["new"] += seg.count(_NEVER)
    cached = seg.count(_CACHED)
    if cached:  # still cached: unreachable behind an earlier miss, or (the first one) not served
        first = seg[0] == _CACHED
        reasons["other"] += first
        reasons["prefix_miss"] += cached - first
    for code, reason in _STATE_REASON.items():
        reasons[reason] += seg.count(code)


def _key(block: int) -> bytes:
    """The key of a trace's block id (ids are dense and unique; no hash needed)."""
    return block.to_bytes(8, "little")


def _block(key: bytes) -> int:
    return int.from_bytes(key, "little")


class _Replayer:
    """One pass over a trace (see the module docstring for the step protocol)."""

    def __init__(self, trace: "Trace", cfg: TierKVConfig, opts: ReplayOptions, executor: Executor) -> None:
        self.trace, self.opts = trace, opts
        self.now = 0.0
        self.spec = policy_spec(cfg)
        self.tracker = _Tracker(trace.id_bound)
        self.keys = [_key(b) for b in range(trace.id_bound)]
        self.lifecycle = {t: LifecycleLog() for t in TIERS}
        self._left: list[tuple[list[bytes], str]] = []
        self.gpu_blocks = cfg.gpu.resolve_num_blocks(cfg.block_nbytes())
        self.manager = BlockManager(self.gpu_blocks, trace.block_size, track_evictions=True)
        self.policy = TierPolicy(self.spec, clock=lambda: self.now,
                                 observers=[LifecycleRecorder({t: self.lifecycle[t] for t in ("cpu", "ssd")}),
                                            self._observe])
        self.executor = executor
        self.running: list[tuple[float, int]] = []
        self.hit_blocks = dict.fromkeys(TIERS, 0)
        self.reasons = dict.fromkeys(MISS_REASONS, 0)
        self.forced = self.peak = self.rejected = self.rejected_max = 0
        self.request_hits: list[dict[str, int]] | None = [] if opts.record_requests else None
        self.gpu_evictions = self.stored_at_eviction = 0

    def _observe(self, kind: str, tier: str, keys: Any, now: float) -> None:
        if kind in ("evicted", "lost", "dropped"):
            self._left.append((list(keys), tier))

    # ------------------------------------------------------------------ requests

    def finish_until(self, now: float) -> None:
        """Free the requests finished by ``now``; then a step with nothing scheduled runs
        (as in vLLM, the step that tells the workers): the page-out window is offered."""
        running = self.running
        freed = False
        while running and running[0][0] <= now:
            fin, rid = heapq.heappop(running)
            self.now = max(self.now, fin)
            self.manager.free(str(rid))
            freed = True
        if freed and self.policy.pageout_blocks:
            self._end_step([], None)

    def _room(self, call: Callable[[], Any]) -> Any:
        """``call()``, finishing running requests early while the pool is too full for it."""
        while True:
            try:
                return call()
            except OutOfBlocksError:
                if not self.running:
                    raise
                _, victim = heapq.heappop(self.running)
                self.manager.free(str(victim))
                self.forced += 1

    def step(self, rid: int) -> None:
        r = self.trace.requests[rid]
        self.policy.forget_pairs(self.executor.take_lost())  # what the SSD tier dropped on its own
        self.finish_until(r.timestamp)
        self.now = max(self.now, r.timestamp)
        n_tokens = r.input_length if self.trace.token_based else len(r.blocks) * self.trace.block_size
        prompt = Prompt(list(map(self.keys.__getitem__, r.blocks)), n_tokens, r.hittable)
        needed = self.manager.blocks_needed(prompt)
        if needed > self.gpu_blocks:
            self.rejected += 1
            self.rejected_max = max(self.rejected_max, needed)
            self.reasons["rejected"] += len(r.blocks)
            if self.request_hits is not None:
                self.request_hits.append({"gpu": 0, "cpu": 0, "ssd": 0})
            return
        before = bytes(map(self.tracker.state.__getitem__, r.blocks))
        hits = self._schedule(str(rid), prompt)
        _classify(before, hits, r.hittable, self.reasons)
        self.tracker.touch(r.blocks, self.now)
        heapq.heappush(self.running, (r.timestamp + r.output_length * self.opts.decode_s_per_token, rid))
        self.peak = max(self.peak, len(self.running))

    def _schedule(self, rid: str, prompt: Prompt) -> int:
        """Steps A (prefix + loads) and B (the rest, computed); returns the blocks served from cache."""
        manager, policy = self.manager, self.policy
        gpu_hits = manager.lookup(prompt)
        below = policy.lookup(prompt.hashes[gpu_hits:prompt.cap])
        if below:
            alloc = self._room(lambda: manager.allocate(rid, prompt=prompt, num_external=len(below),
                                                        num_blocks=gpu_hits + len(below)))
        else:
            alloc = self._room(lambda: manager.allocate(rid, prompt=prompt))
        policy.touch(prompt.hashes[:gpu_hits])
        self._gpu_hits(prompt.hashes[:gpu_hits])
        loaded = 0
        if below:
            load = policy.prepare_load(rid, prompt.hashes[gpu_hits:gpu_hits + len(below)],
                                       alloc.block_ids[gpu_hits:gpu_hits + len(below)])
            loaded = self._end_step([], load)
            if loaded < len(below):
                manager.invalidate(rid, gpu_hits + loaded)
            self.lifecycle["gpu"].enter_many(prompt.hashes[gpu_hits:gpu_hits + loaded], self.now)
            self._room(lambda: manager.grow(rid))
        computed = manager.commit(rid)
        self._note_computed(computed)
        self._end_step(computed, None)
        self.hit_blocks["gpu"] += gpu_hits
        for tier in below[:loaded]:
            self.hit_blocks[tier] += 1
        if self.request_hits is not None:
            self.request_hits.append({"gpu": gpu_hits, "cpu": below[:loaded].count("cpu"),
                                      "ssd": below[:loaded].count("ssd")})
        return gpu_hits + loaded

    def _end_step(self, computed: list[tuple[int, bytes]], load: LoadPlan | None) -> int:
        """Offer evicted, computed and page-out blocks; run and complete the step's plans."""
        policy = self.policy
        plans: list[StorePlan] = []
        evicted = self.manager.take_evicted()
        if evicted:
            self._gpu_evicted(evicted)
            if policy.admits(EVICTED):
                plans.append(policy.prepare_store([b for b, _ in evicted], [h for _, h in evicted], EVICTED))
                self.stored_at_eviction += len(plans[-1])
        if computed and policy.admits(COMPUTED):
            plans.append(policy.prepare_store([b for b, _ in computed], [h for _, h in computed], COMPUTED))
        if policy.pageout_blocks:
            window = self.manager.free_window(policy.pageout_blocks)
            if window:
                plans.append(policy.prepare_store([b for b, _ in window], [h for _, h in window], PAGEOUT))
        results = [(plan, self.executor.store(plan) if not plan.empty else []) for plan in plans]
        loaded = 0
        if load is not None:
            result = self.executor.load(load)
            loaded = result.loaded
        for plan, lost in results:
            policy.complete_store(plan, lost)
        if load is not None:
            policy.complete_load(load, result.lost, loaded)
        self._settle([h for _, h in evicted])
        return loaded

    # ------------------------------------------------------------------ accounting

    def _gpu_hits(self, keys: list[bytes]) -> None:
        self.lifecycle["gpu"].access_many(keys, self.now)

    def _note_computed(self, computed: list[tuple[int, bytes]]) -> None:
        """Computed blocks the pool registered enter it (a duplicate of a cached block does not)."""
        blocks = self.manager.blocks
        self.lifecycle["gpu"].enter_many([k for b, k in computed if blocks[b].block_hash == k], self.now)

    def _gpu_evicted(self, evicted: list[tuple[int, bytes]]) -> None:
        self.lifecycle["gpu"].leave_many([h for _, h in evicted], self.now)
        self.gpu_evictions += len(evicted)

    def _settle(self, gpu_evicted: list[bytes]) -> None:
        """Blocks that left a tier in this step and are held nowhere now have left the cache."""
        left, self._left = self._left, []
        holdings = self.policy.holdings
        cached, in_cpu, in_ssd, now = self.manager.cached, holdings.in_cpu, holdings.in_ssd, self.now
        leave = self.tracker.left_many
        for keys, tier in [*left, (gpu_evicted, "gpu")]:  # a lower tier first: it held the block last
            gone = [k for k in keys if k not in cached and k not in in_cpu and k not in in_ssd]
            if gone:
                leave(gone, tier, now)

    def close(self) -> dict[str, Any]:
        self.finish_until(float("inf"))
        stats = {**policy_stats(self.policy, gpu_evictions=self.gpu_evictions,
                                gpu_cached=self.manager.num_cached_blocks, gpu_blocks=self.gpu_blocks),
                 "spills_at_eviction": self.stored_at_eviction,
                 "executor": self.executor.stats(),
                 "lifecycle": {t: lc.samples() for t, lc in self.lifecycle.items()}}
        device = getattr(self.executor.device, "engine", None)
        stats["transfer"] = {d: dict(v) for d, v in device.moved.items()} if device is not None else {}
        return stats


def _payload_config(cfg: TierKVConfig, block_bytes: int, ssd_dir: str) -> TierKVConfig:
    """Same capacities in blocks, with ``block_bytes`` per block and the SSD tier in ``ssd_dir``."""
    from tierkv.tiers.ssd.record import NS_LEN, record_footprint

    caps = tier_capacities(cfg)
    ssd_cap = cfg.ssd.capacity
    if caps["ssd"]:  # the capacity that holds as many blocks of the new size (see capacity_blocks)
        ssd_cap = caps["ssd"] * record_footprint(NS_LEN + 32, block_bytes)
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, block_nbytes=block_bytes),
        gpu=dataclasses.replace(cfg.gpu, num_blocks=caps["gpu"], capacity=None),
        cpu=dataclasses.replace(cfg.cpu, capacity=caps["cpu"] * block_bytes),
        ssd=dataclasses.replace(cfg.ssd, path=ssd_dir, capacity=ssd_cap),
    )


def _payload_executor(cfg: TierKVConfig) -> Executor:
    """Real bytes: a host 'device' pool, the CPU slab and an SSD tier (``cfg.ssd.path``)."""
    import torch

    from tierkv.executor import PoolRows
    from tierkv.tiers.host import HostSlab
    from tierkv.tiers.ssd import SSDTier
    from tierkv.transfer import TransferEngine

    spec, nbytes = policy_spec(cfg), cfg.block_nbytes()
    pool = torch.zeros((cfg.gpu.resolve_num_blocks(nbytes), nbytes), dtype=torch.uint8)
    slab = HostSlab(spec.cpu_slots, nbytes, pin_memory=False) if spec.cpu_slots else None
    ssd = SSDTier(cfg.ssd.path, capacity_bytes=cfg.ssd.capacity, fingerprint="tierkv-bench", compression="none",
                  block_nbytes=nbytes) if spec.ssd_slots else None
    return Executor(PoolRows(TransferEngine(pool)), slab, ssd)


def replay(trace: "Trace", config: TierKVConfig, options: ReplayOptions = ReplayOptions(),
           progress: Callable[[int], None] | None = None) -> ReplayResult:
    """Drive ``trace`` through the tier policy of ``config`` (see the module docstring)."""
    try:
        cfg = config_for_trace(config, trace.block_size, options.admission)
        caps = tier_capacities(cfg)
    except ConfigError as exc:
        raise ReplayError(str(exc)) from None
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-") as tmp:
        run_cfg = _payload_config(cfg, options.payload_block_bytes, tmp) if options.payload else cfg
        executor = _payload_executor(run_cfg) if options.payload else NullExecutor()
        t0 = time.perf_counter()
        rp = _Replayer(trace, run_cfg, options, executor)
        try:
            for rid in range(len(trace.requests)):
                rp.step(rid)
                if progress is not None and rid & 255 == 255:
                    progress(rid + 1)
        finally:
            stats = rp.close()
            if executor.ssd is not None:
                executor.ssd.close()
        wall = time.perf_counter() - t0
    return ReplayResult(cfg, rp.spec, caps, len(trace.requests), trace.num_accesses, rp.hit_blocks, rp.reasons,
                        rp.forced, rp.peak, wall, stats, rp.rejected, rp.rejected_max,
                        _admit_hint(config, rp.rejected_max * trace.block_size) if rp.rejected else None,
                        rp.request_hits or [], rp.tracker.lifetime, rp.tracker.idle,
                        options.payload_block_bytes if options.payload else None)


def _admit_hint(original: TierKVConfig, tokens: int) -> str:
    """The ``--set`` that gives the GPU pool room for ``tokens`` (in the config's own units)."""
    if original.gpu.num_blocks is not None:
        return f"--set gpu.num_blocks={-(-tokens // original.block_size)} or more for concurrent requests"
    need = int(tokens * original.block_nbytes() / original.block_size)
    return f"--set gpu.capacity={-(-need // 1024**3)}GiB or more"
