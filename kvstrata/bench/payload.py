"""A replay that moves real bytes (``--payload``): a host pool, the CPU slab and an SSD tier.

The tiers hold the same number of blocks as the replayed config's, with
``payload_block_bytes`` per block; the SSD tier lives in a temporary directory.

Threads: the replay's one thread (the SSD tier writes on its own).
"""

from __future__ import annotations

import dataclasses

from kvstrata.config.schema import KVStrataConfig
from kvstrata.bench.capacity import SLAB_KIND, STORE_KIND, policy_spec, tier_capacities
from kvstrata.dataplane.executor import Executor
from kvstrata.policy.tiers import GPU

__all__ = ["payload_config", "payload_executor"]


def payload_config(cfg: KVStrataConfig, block_bytes: int, store_dir: str) -> KVStrataConfig:
    """Same capacities in blocks, with ``block_bytes`` per block and the SSD tier (the persistent
    store) in ``store_dir``."""
    from kvstrata.tiers.ssd.record import NS_LEN, record_footprint

    caps = tier_capacities(cfg)
    store = cfg.ssd
    if caps[STORE_KIND]:  # the capacity that holds as many blocks of the new size (see capacity_blocks)
        store = dataclasses.replace(store, capacity=caps[STORE_KIND] * record_footprint(NS_LEN + 32, block_bytes))
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, block_nbytes=block_bytes),
        gpu=dataclasses.replace(cfg.gpu, num_blocks=caps[GPU], capacity=None),
        cpu=dataclasses.replace(cfg.cpu, capacity=caps[SLAB_KIND] * block_bytes),
        ssd=dataclasses.replace(store, path=store_dir),
    )


def payload_executor(cfg: KVStrataConfig) -> Executor:
    """Real bytes: a host 'device' pool, the CPU slab and an SSD tier (``cfg.ssd.path``), opened
    by the deployment builder. Every tier gets the same asks, each kind reading its own: never
    pinned (the DRAM slab), uncompressed (the SSD tier), under a tier id of the bench's."""
    import dataclasses

    import torch

    from kvstrata.core.deployment import executor_over, open_backends
    from kvstrata.dataplane.device_rows import PoolRows
    from kvstrata.dataplane.transfer import TransferEngine

    spec, nbytes = policy_spec(cfg), cfg.block_nbytes()
    local = dataclasses.replace(spec, tiers=spec.tiers.with_shared(None)) if spec.tiers is not None else spec
    pool = torch.zeros((cfg.gpu.resolve_num_blocks(nbytes), nbytes), dtype=torch.uint8)
    asked = {"pin": False, "tier_id": "kvstrata-bench", "compression": "none"}
    options = {t.name: asked for t in local.tiers or ()}
    backends = open_backends(cfg, local, None, nbytes, options=options)
    return executor_over(PoolRows(TransferEngine(pool)), backends)
