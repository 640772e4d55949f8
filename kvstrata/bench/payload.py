"""A replay that moves real bytes (``--payload``): a host pool, the CPU slab and an SSD tier.

The tiers hold the same number of blocks as the replayed config's, with
``payload_block_bytes`` per block; the SSD tier lives in a temporary directory.

Threads: the replay's one thread (the SSD tier writes on its own).
"""

from __future__ import annotations

import dataclasses

from kvstrata.config.schema import SSD_TIER_KEYS, KVStrataConfig
from kvstrata.errors import config_keys
from kvstrata.bench.capacity import policy_spec, tier_capacities
from kvstrata.dataplane.executor import Executor
from kvstrata.policy.tiers import CPU, GPU, SSD

__all__ = ["payload_config", "payload_executor"]


def payload_config(cfg: KVStrataConfig, block_bytes: int, ssd_dir: str) -> KVStrataConfig:
    """Same capacities in blocks, with ``block_bytes`` per block and the SSD tier in ``ssd_dir``."""
    from kvstrata.tiers.ssd.record import NS_LEN, record_footprint

    caps = tier_capacities(cfg)
    ssd_cap = cfg.ssd.capacity
    if caps[SSD]:  # the capacity that holds as many blocks of the new size (see capacity_blocks)
        ssd_cap = caps[SSD] * record_footprint(NS_LEN + 32, block_bytes)
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, block_nbytes=block_bytes),
        gpu=dataclasses.replace(cfg.gpu, num_blocks=caps[GPU], capacity=None),
        cpu=dataclasses.replace(cfg.cpu, capacity=caps[CPU] * block_bytes),
        ssd=dataclasses.replace(cfg.ssd, path=ssd_dir, capacity=ssd_cap),
    )


def payload_executor(cfg: KVStrataConfig) -> Executor:
    """Real bytes: a host 'device' pool, the CPU slab and an SSD tier (``cfg.ssd.path``)."""
    import torch

    from kvstrata.dataplane.executor import PoolRows
    from kvstrata.tiers.host import HostSlab
    from kvstrata.tiers.ssd import SSDTier
    from kvstrata.dataplane.transfer import TransferEngine

    spec, nbytes = policy_spec(cfg), cfg.block_nbytes()
    pool = torch.zeros((cfg.gpu.resolve_num_blocks(nbytes), nbytes), dtype=torch.uint8)
    slab = HostSlab(spec.cpu_slots, nbytes, pin_memory=False) if spec.cpu_slots else None
    with config_keys(SSD_TIER_KEYS):
        ssd = SSDTier(cfg.ssd.path, capacity_bytes=cfg.ssd.capacity, fingerprint="kvstrata-bench",
                      compression="none", block_nbytes=nbytes) if spec.ssd_slots else None
    return Executor(PoolRows(TransferEngine(pool)), slab, ssd)
