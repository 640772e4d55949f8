"""Replay a trace through the real :class:`tierkv.tiered.TieredKVCache`.

Hash-id traces (Mooncake, Qwen-Bailian): every id is a full block that may
hit; the request is handed to the cache as its block hashes without a token
count, so it takes ``len(hash_ids)`` GPU blocks and no last-token cap applies.

Request lifetimes: a request holds its GPU blocks from arrival until
``arrival + output_length * decode_s_per_token`` (prefill time and the
output tokens' own blocks are not modelled). Requests that have finished are
freed, in finishing order and at their finishing time, before the next
arrival is allocated. When the GPU pool has too few free blocks for an
arrival, running requests are finished early, earliest finisher first, and
counted as ``forced_frees``: a non-zero count means the pool is smaller than
the trace's concurrency at this decode speed.

Capacities: the trace's block size replaces the config's ``block_size``;
tier capacities keep their meaning in tokens and bytes (``gpu.num_blocks``
is converted to the same number of tokens). Without payload the tiers are
metadata only; ``payload=True`` moves real bytes (``payload_block_bytes``
per block) through the CPU slab and an LMDB tier in a temporary directory,
with the tiers holding the same number of blocks as without payload.
"""

from __future__ import annotations

import dataclasses
import heapq
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from tierkv.config import TierKVConfig
from tierkv.errors import OutOfBlocksError

if TYPE_CHECKING:
    from tierkv.bench.traces import Trace

__all__ = ["TIERS", "MISS_REASONS", "ReplayError", "ReplayOptions", "ReplayResult", "config_for_trace",
           "tier_capacities", "replay"]

TIERS = ("gpu", "cpu", "ssd")
MISS_REASONS = ("new", "evicted_gpu", "evicted_cpu", "evicted_ssd", "prefix_miss", "last_token", "other")

# per-block state while replaying
_NEVER, _CACHED = 0, 1
_DROPPED = {"gpu": 2, "cpu": 3, "ssd": 4}
_STATE_REASON = {2: "evicted_gpu", 3: "evicted_cpu", 4: "evicted_ssd"}


class ReplayError(ValueError):
    """The configuration cannot replay this trace (e.g. a request larger than the GPU pool)."""


@dataclass(frozen=True)
class ReplayOptions:
    """How requests are timed and whether bytes move."""

    decode_s_per_token: float = 0.02
    payload: bool = False
    payload_block_bytes: int = 16 * 1024


@dataclass
class ReplayResult:
    """Counts from one replay (block counts are of the trace's block size)."""

    config: TierKVConfig
    capacity_blocks: dict[str, int]
    requests: int
    accesses: int
    hit_blocks: dict[str, int]
    miss_reasons: dict[str, int]
    forced_frees: int
    peak_running: int
    wall_s: float
    stats: dict[str, Any]
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

    def lifecycle(self, tier: str, what: str) -> list[float]:
        """Raw samples ``what`` (lifetime_s | idle_before_evict_s | reuse_gap_s) of ``tier``."""
        return list(self.stats.get("lifecycle", {}).get(tier, {}).get(what, []) or [])


def _gpu_tokens(cfg: TierKVConfig) -> int | None:
    return cfg.gpu.num_blocks * cfg.block_size if cfg.gpu.num_blocks is not None else None


def config_for_trace(cfg: TierKVConfig, block_size: int) -> TierKVConfig:
    """``cfg`` with the trace's block size, keeping every capacity in tokens/bytes."""
    model, gpu = cfg.model, cfg.gpu
    if model.block_nbytes is not None:
        per_token = model.block_nbytes / cfg.block_size
        model = dataclasses.replace(model, block_nbytes=max(1, round(per_token * block_size)))
    tokens = _gpu_tokens(cfg)
    if tokens is not None:
        gpu = dataclasses.replace(gpu, num_blocks=max(1, tokens // block_size))
    return dataclasses.replace(cfg, block_size=block_size, model=model, gpu=gpu)


def tier_capacities(cfg: TierKVConfig) -> dict[str, int]:
    """Blocks each tier holds under ``cfg``."""
    nbytes = cfg.block_nbytes()
    return {
        "gpu": cfg.gpu.resolve_num_blocks(nbytes),
        "cpu": cfg.cpu.capacity // nbytes,
        "ssd": cfg.ssd.capacity // nbytes if cfg.ssd.enabled else 0,
    }


def _payload_config(cfg: TierKVConfig, block_bytes: int, ssd_dir: str) -> TierKVConfig:
    """Same capacities in blocks, with ``block_bytes`` per block and the SSD tier in ``ssd_dir``."""
    caps = tier_capacities(cfg)
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, block_nbytes=block_bytes),
        gpu=dataclasses.replace(cfg.gpu, num_blocks=caps["gpu"], capacity=None),
        cpu=dataclasses.replace(cfg.cpu, capacity=caps["cpu"] * block_bytes),
        ssd=dataclasses.replace(cfg.ssd, path=ssd_dir, capacity=caps["ssd"] * block_bytes),
    )


def _num_tokens(trace: "Trace", r: Any) -> int | None:
    """Prompt tokens handed to the cache; None for hash-id traces, whose ids are full blocks
    that may all hit (the cache then applies no last-token cap)."""
    return r.input_length if trace.token_based else None


def _blocks_needed(trace: "Trace") -> tuple[int, int]:
    """(most GPU blocks one request needs, its line)."""
    bs, worst, line = trace.block_size, 0, 0
    for r in trace.requests:
        n = _num_tokens(trace, r)
        need = len(r.blocks) if n is None else -(-n // bs)
        if need > worst:
            worst, line = need, r.line
    return worst, line


def check_fits(trace: "Trace", cfg: TierKVConfig, gpu_blocks: int, original: TierKVConfig) -> None:
    """Raise :class:`ReplayError` if one request alone needs more blocks than the GPU pool has."""
    need, line = _blocks_needed(trace)
    if need <= gpu_blocks:
        return
    where = f"{trace.name}:{line}: " if line else ""
    unit = original.block_size
    hint = (f"--set gpu.num_blocks={-(-need * trace.block_size // unit)}" if original.gpu.num_blocks is not None
            else f"--set gpu.capacity={need * cfg.block_nbytes()}")
    raise ReplayError(f"{where}a request needs {need} blocks of {trace.block_size} tokens "
                      f"({need * trace.block_size:,} tokens) but the GPU pool holds {gpu_blocks} "
                      f"({gpu_blocks * trace.block_size:,} tokens); raise it to at least that ({hint}) "
                      "or more for concurrent requests")


class _Tracker:
    """Per-block state for miss reasons and whole-cache lifetimes (via ``on_drop``)."""

    def __init__(self, id_bound: int, clock: list[float]) -> None:
        self.state = bytearray(id_bound)
        self.entered = [0.0] * id_bound
        self.last = [0.0] * id_bound
        self.clock = clock
        self.lifetime: list[float] = []
        self.idle: list[float] = []

    def on_drop(self, block_hash: bytes, tier: str) -> None:
        b = int.from_bytes(block_hash[:8], "little")
        if self.state[b] != _CACHED:
            return
        now = self.clock[0]
        self.state[b] = _DROPPED.get(tier, 2)
        self.lifetime.append(now - self.entered[b])
        self.idle.append(now - self.last[b])

    def touch(self, blocks: list[int], now: float) -> None:
        state, entered, last = self.state, self.entered, self.last
        for b in blocks:
            if state[b] != _CACHED:
                state[b] = _CACHED
                entered[b] = now
            last[b] = now


def _classify(blocks: list[int], before: list[int], hit: int, hittable: int, reasons: dict[str, int]) -> None:
    for j in range(hit, len(blocks)):
        s = before[j]
        if j >= hittable:
            reasons["last_token"] += 1
        elif s == _NEVER:
            reasons["new"] += 1
        elif s == _CACHED:
            reasons["prefix_miss" if j > hit else "other"] += 1
        else:
            reasons[_STATE_REASON[s]] += 1


def _hash_of(block: int) -> bytes:
    return block.to_bytes(8, "little") + bytes(24)


class _Replayer:
    def __init__(self, trace: "Trace", cfg: TierKVConfig, opts: ReplayOptions, payload_cfg: TierKVConfig | None):
        from tierkv.tiered import TieredKVCache

        self.trace, self.opts = trace, opts
        self.clock = [0.0]
        self.tracker = _Tracker(trace.id_bound, self.clock)
        self.cache = TieredKVCache(payload_cfg or cfg, payload=opts.payload, clock=lambda: self.clock[0],
                                   record_samples=True, on_drop=self.tracker.on_drop)
        self.running: list[tuple[float, int]] = []
        self.hit_blocks = dict.fromkeys(TIERS, 0)
        self.reasons = dict.fromkeys(MISS_REASONS, 0)
        self.forced = 0
        self.peak = 0

    def finish_until(self, now: float) -> None:
        running, clock = self.running, self.clock
        while running and running[0][0] <= now:
            fin, rid = heapq.heappop(running)
            clock[0] = max(clock[0], fin)
            self.cache.free(rid)

    def allocate(self, rid: int, hashes: list[bytes], num_tokens: int | None) -> Any:
        while True:
            try:
                return self.cache.allocate(rid, block_hashes=hashes, num_tokens=num_tokens)
            except OutOfBlocksError:
                if not self.running:
                    raise ReplayError(f"{self.trace.name}: request {rid} does not fit the empty GPU pool") from None
                _, victim = heapq.heappop(self.running)
                self.cache.free(victim)
                self.forced += 1

    def step(self, rid: int) -> None:
        r = self.trace.requests[rid]
        now = r.timestamp
        self.finish_until(now)
        self.clock[0] = max(self.clock[0], now)
        before = [self.tracker.state[b] for b in r.blocks]
        a = self.allocate(rid, [_hash_of(b) for b in r.blocks], _num_tokens(self.trace, r))
        hit = 0
        for tier, n in a.hit_blocks.items():
            self.hit_blocks[tier] += n
            hit += n
        _classify(r.blocks, before, hit, r.hittable, self.reasons)
        self.tracker.touch(r.blocks, now)
        heapq.heappush(self.running, (now + r.output_length * self.opts.decode_s_per_token, rid))
        self.peak = max(self.peak, len(self.running))

    def close(self) -> dict[str, Any]:
        self.finish_until(float("inf"))
        stats = self.cache.stats()
        self.cache.close()
        return stats


def replay(trace: "Trace", config: TierKVConfig, options: ReplayOptions = ReplayOptions(),
           progress: Callable[[int], None] | None = None) -> ReplayResult:
    """Drive ``trace`` through a :class:`~tierkv.tiered.TieredKVCache` built from ``config``."""
    cfg = config_for_trace(config, trace.block_size)
    caps = tier_capacities(cfg)
    check_fits(trace, cfg, caps["gpu"], config)
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-") as tmp:
        payload_cfg = _payload_config(cfg, options.payload_block_bytes, tmp) if options.payload else None
        t0 = time.perf_counter()
        rp = _Replayer(trace, cfg, options, payload_cfg)
        try:
            for rid in range(len(trace.requests)):
                rp.step(rid)
                if progress is not None and rid & 255 == 255:
                    progress(rid + 1)
        finally:
            stats = rp.close()
        wall = time.perf_counter() - t0
    return ReplayResult(cfg, caps, len(trace.requests), trace.num_accesses, rp.hit_blocks, rp.reasons,
                        rp.forced, rp.peak, wall, stats, rp.tracker.lifetime, rp.tracker.idle,
                        options.payload_block_bytes if options.payload else None)
