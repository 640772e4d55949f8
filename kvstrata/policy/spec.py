"""The policy's parameters: tier sizes in blocks and the placement rules, from a config.

Capacities in bytes become capacities in blocks by each tier kind's capacity rule
(:mod:`kvstrata.tiers.kinds`), in the deployment builder
(:func:`kvstrata.core.deployment.policy_spec`), for every mode (library, vLLM connector, bench
replay); the spec takes the declarations with their capacities.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from kvstrata.config.schema import ADMISSIONS, ON_COMPUTE, ON_EVICT, PROMOTIONS, KVStrataConfig, check_spill_rules
from kvstrata.errors import ConfigError
from kvstrata.policy.plans import COMPUTED, EVICTED, PAGEOUT, SHUTDOWN
from kvstrata.policy.positions import default_rho
from kvstrata.policy.tiers import LOWER, TierList, declare

__all__ = ["PolicySpec", "ADMISSIONS", "PROMOTIONS", "ON_COMPUTE", "ON_EVICT", "check_spill_rules"]

DEFAULT_RHO = default_rho(8, 128)  # an 8B model's layout (Llama-3-8B: 8 KV heads of 128)
_ADMITTED = {ON_COMPUTE: (COMPUTED, SHUTDOWN), ON_EVICT: (PAGEOUT, EVICTED, SHUTDOWN)}



@dataclass(frozen=True)
class PolicySpec:
    """Placement rules and lower-tier sizes (in blocks; 0 = no such tier).

    ``admission``: ``on_compute`` stores every block as soon as it is computed;
    ``on_evict`` stores a block when the device pool evicts it, paging out the
    ``pageout_blocks`` least recently used free device blocks ahead of time.
    ``promotion``: ``inclusive`` keeps the lower copy of a loaded block,
    ``exclusive`` moves it out of the slab tier (persistent copies always stay).
    ``write_through``: every block stored to the slab tier also goes to the
    persistent tier; otherwise blocks reach it when the tiers above evict them.
    ``shared``: a shared tier (not held here: other replicas write to it and its
    server evicts on its own) receives every block new to this replica's lower tiers,
    and serves hits by a fetch into slab slots (needs a slab tier).
    ``tiers``: the declarations (:mod:`kvstrata.policy.tiers`); by default those of
    ``slab_slots``, ``store_slots``, ``write_through`` and ``shared``. When given, the
    sizes are read from it.
    ``attention_share``: attention's share of a token's compute per context token
    (``rho`` of :mod:`kvstrata.policy.positions`), which a ``cost`` eviction order
    weighs positions by until the driver measures it.
    """

    slab_slots: int = 0
    store_slots: int = 0
    admission: str = ON_COMPUTE
    promotion: str = "inclusive"
    write_through: bool = True
    pageout_blocks: int = 0
    shared: bool = False
    tiers: TierList | None = None
    attention_share: float = DEFAULT_RHO

    def __post_init__(self) -> None:
        check_spill_rules(self.admission, self.promotion)
        for name in ("slab_slots", "store_slots", "pageout_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name}: expected a non-negative integer, got {value!r}")
        if not isinstance(self.write_through, bool):
            raise ConfigError(f"spill.write_through: expected true or false, got {self.write_through!r}")
        tiers = self.tiers
        if tiers is None:
            tiers = declare(self.slab_slots, self.store_slots or None, write_through=self.write_through,
                            remote_server="given" if self.shared else None)
            object.__setattr__(self, "tiers", tiers)
        elif not isinstance(tiers, TierList):
            raise ConfigError(f"tiers: expected a TierList, got {type(tiers).__name__}")
        slab, store = tiers.slab(), tiers.store()
        object.__setattr__(self, "slab_slots", slab.capacity if slab is not None else 0)
        object.__setattr__(self, "store_slots", store.capacity if store is not None else 0)
        object.__setattr__(self, "shared", bool(tiers.shared))

    @classmethod
    def from_tiers(cls, config: "KVStrataConfig", tiers: TierList, *, gpu_blocks: int) -> "PolicySpec":
        """The spec a deployment of ``config`` runs over ``tiers`` (their capacities in blocks:
        :func:`kvstrata.core.deployment.policy_spec` declares them by the tier kinds' capacity
        rules) and a device pool of ``gpu_blocks`` blocks."""
        spill = config.spill
        lower = any(t.capacity for t in tiers.local)
        pageout = max(1, int(spill.watermark * gpu_blocks)) if spill.admission == ON_EVICT and lower else 0
        load, model = config.load, config.model
        rho = load.prefill_rate / load.attention_rate if load.prefill_rate and load.attention_rate \
            else default_rho(model.kv_heads, model.head_size)
        return cls(admission=spill.admission, promotion=spill.promotion, write_through=spill.write_through,
                   pageout_blocks=pageout, tiers=tiers, attention_share=rho)

    def admits(self, reason: str) -> bool:
        """Does admission take blocks offered for ``reason``?"""
        return reason in _ADMITTED[self.admission]

    def capacity(self) -> dict[str, int]:
        """Blocks each lower tier holds at most (every built-in local kind, 0: off, then the
        deployment's other local tiers)."""
        assert self.tiers is not None
        return {**dict.fromkeys(LOWER, 0), **self.tiers.capacity()}

    @functools.cached_property
    def has_lower_tier(self) -> bool:
        return any(self.capacity().values())

    def lower_blocks(self) -> int:
        """Distinct blocks the tiers below the device can hold (with write-through the
        persistent tier also holds what the tiers above it hold)."""
        held = sum(self.capacity().values())
        if self.write_through:
            return max(held - self.store_slots, self.store_slots)
        return held

    def effective_blocks(self, gpu_blocks: int) -> int:
        """Distinct blocks the whole hierarchy can hold (approximately): ``on_evict`` keeps
        the device pool and the tiers below disjoint; ``on_compute`` copies every
        computed block down, so the tiers below also hold what the device holds."""
        if self.admission == ON_EVICT:
            return gpu_blocks + self.lower_blocks()
        return max(gpu_blocks, self.lower_blocks())


#: the window ``second_hit`` admission remembers by default: as many keys as the tier holds
#: blocks, at most this many (~24 MB of the scheduler's memory)
DEFAULT_GHOST_KEYS = 1 << 20


def ghost_keys(section: Any, tier_blocks: int | None) -> int:
    """The ghost window of a tier's ``section`` (``ghost_keys``, else the default)."""
    if section.ghost_keys is not None:
        return int(section.ghost_keys)
    return max(1, min(tier_blocks or DEFAULT_GHOST_KEYS, DEFAULT_GHOST_KEYS))
