"""What a replay is asked to do (:class:`ReplayOptions`) and what it counted (:class:`ReplayResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from kvstrata.bench.stats import Quantiles
from kvstrata.config.schema import KVStrataConfig
from kvstrata.core.metrics import TIERS
from kvstrata.policy import PolicySpec
from kvstrata.policy.positions import flops_per_token
from kvstrata.policy.tiers import PERSISTENT

__all__ = ["ReplayError", "ReplayOptions", "ReplayResult", "persistent"]


class ReplayError(ValueError):
    """The configuration cannot replay this trace."""


@dataclass(frozen=True)
class ReplayOptions:
    """How requests are timed, whether bytes move, and which admission runs."""

    decode_s_per_token: float = 0.02
    payload: bool = False
    payload_block_bytes: int = 16 * 1024
    admission: str | None = None   # None: the config's spill.admission
    load_policy: str | None = None  # None: the config's load.policy (decided only from load.* figures)
    record_requests: bool = False  # keep each request's hits per tier (ReplayResult.request_hits)
    explain: bool = False          # keep why each request's first missed block missed (ReplayResult.misses)
    max_memory: int | None = None  # bytes the deployment may cost to replay (None: half the machine's memory)


@dataclass
class ReplayResult:
    """Counts from one replay (block counts are of the trace's block size)."""

    config: KVStrataConfig
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
    cache_lifetime_s: Quantiles = field(default_factory=Quantiles)
    cache_idle_before_evict_s: Quantiles = field(default_factory=Quantiles)
    payload_block_bytes: int | None = None
    config_block_size: int = 0  # the block size of the config as given (its capacities' unit)
    prompt_tokens: int = 0      # of every request replayed
    misses: list[dict[str, Any]] = field(default_factory=list)
    preempted_hit_blocks: dict[str, int] = field(default_factory=dict)  # on resuming (recorded preemptions)
    ttft_s: Quantiles | None = None  # each request's TTFT as load.* figures estimate it (None: no figures)
    load: dict[str, Any] | None = None  # the load-or-recompute policy, figures and decisions (with figures)
    compute_saved: float = 0.0  # the hits' prefill compute, in blocks without context (policy.positions)
    #: the tiers the replica held blocks in, as statistics name them: the device, then its
    #: policy's lower tiers (every built-in local kind, then the deployment's others)
    tiers: tuple[str, ...] = TIERS

    def flops_saved(self) -> float:
        """The prefill FLOPs the hits saved, estimated from the model's KV layout and the
        attention's share (:mod:`kvstrata.policy.positions`)."""
        m = self.config.model
        return flops_per_token(m.layers, m.kv_heads, m.head_size) * self.config.block_size * self.compute_saved

    def persistent_bytes_written(self) -> int:
        """Bytes the replay stored to the tiers whose records persist on a drive (the SSD tier:
        :data:`~kvstrata.policy.tiers.PERSISTENT`), blocks x the block's bytes, before compression."""
        return persistent(self.stats.get("spills", {})) * self.config.block_nbytes()

    def persistent_blocks(self) -> int:
        """Blocks the tiers whose records persist on a drive hold at most (0: none)."""
        return persistent(self.capacity_blocks)

    def slab_blocks(self) -> int:
        """Blocks the slab tier (DRAM slots the device copies to and from) holds (0: none)."""
        return self.spec.slab_slots

    @property
    def hits(self) -> int:
        return sum(self.hit_blocks.values())

    def hit_rate(self) -> dict[str, float]:
        """Per tier (:attr:`tiers`, then the shared tier when it was modelled) and in total."""
        n = self.accesses or 1
        rates = {t: self.hit_blocks[t] / n for t in self.hit_tiers()}
        rates["total"] = self.hits / n
        return rates

    def hit_tiers(self) -> tuple[str, ...]:
        """The tiers hits were counted in: :attr:`tiers`, then the shared tier when it was modelled."""
        return (*(t for t in self.tiers if t in self.hit_blocks), *(t for t in self.hit_blocks if t not in self.tiers))

    def lifecycle(self, tier: str, what: str) -> Quantiles:
        """Samples ``what`` (lifetime_s | idle_before_evict_s | reuse_gap_s) of ``tier``."""
        got = self.stats.get("lifecycle", {}).get(tier, {}).get(what)
        return got if got is not None else Quantiles()


def persistent(counts: Mapping[str, Any]) -> int:
    """The sum of per-tier ``counts`` over the tiers whose records persist on a drive
    (:data:`~kvstrata.policy.tiers.PERSISTENT`)."""
    return sum(int(counts.get(t, 0)) for t in PERSISTENT)
