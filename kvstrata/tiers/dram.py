"""The CPU DRAM tier as a tier kind: a slab of (pinned) host memory in ``cpu.capacity`` whole
blocks, whose slots the device copies to and from directly (:class:`~kvstrata.tiers.host.HostSlab`)."""

from __future__ import annotations

import dataclasses

from kvstrata.config.schema import KVStrataConfig
from kvstrata.policy.tiers import CPU, KNOWN, Tier
from kvstrata.tiers.host import HostSlab
from kvstrata.tiers.kinds import Opening, TierKind, register

__all__ = ["dram_capacity", "open_slab", "declare_dram"]


def dram_capacity(config: KVStrataConfig, block_nbytes: int) -> int | None:
    """Whole blocks in ``cpu.capacity`` (None: no CPU tier)."""
    return config.cpu.capacity // block_nbytes or None


def open_slab(opening: Opening) -> HostSlab:
    """The slab: ``capacity`` slots, page-locked as ``cpu.pin`` says (``options["pin"]`` in its
    place: a replay's payload run is never pinned; unset: when CUDA is available)."""
    pin = opening.options.get("pin", opening.config.cpu.pin)
    return HostSlab(opening.capacity, opening.block_nbytes, pin_memory=pin)


def declare_dram(config: KVStrataConfig, capacity: int) -> Tier:
    """The DRAM tier's declaration: ``capacity`` slots evicted in ``cpu.eviction``'s order."""
    return dataclasses.replace(KNOWN[CPU], capacity=capacity, eviction=config.cpu.eviction)


register(TierKind(KNOWN[CPU], section="cpu", capacity=dram_capacity, open=open_slab, backend=HostSlab,
                  position=100, configure=declare_dram))
