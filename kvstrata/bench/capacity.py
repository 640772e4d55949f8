"""A config as a replay runs it: the trace's block size, and each tier's capacity in blocks.

Capacities keep their meaning in tokens and bytes when the block size changes
(``gpu.num_blocks`` becomes the same number of tokens). :data:`SLAB_KIND` and
:data:`STORE_KIND` name the built-in kinds of the two local roles, whose config sections
the bench sizes itself (``--compare``'s points, a payload replay, a recommendation).
"""

from __future__ import annotations

import dataclasses

from kvstrata.config.schema import KVStrataConfig
from kvstrata.core.deployment import policy_spec as deployment_spec
from kvstrata.policy import PolicySpec
from kvstrata.policy.tiers import GPU, KNOWN, LOWER, PERSISTENT

__all__ = ["SLAB_KIND", "STORE_KIND", "config_for_trace", "policy_spec", "tier_capacities"]

#: the built-in kind of the slab role (DRAM slots the device copies to and from), as statistics name it
SLAB_KIND = next(name for name in LOWER if KNOWN[name].slab)
#: the built-in kind of the store role (its records persist on a drive), as statistics name it
STORE_KIND = PERSISTENT[-1]


def _gpu_tokens(cfg: KVStrataConfig) -> int | None:
    return cfg.gpu.num_blocks * cfg.block_size if cfg.gpu.num_blocks is not None else None


def config_for_trace(cfg: KVStrataConfig, block_size: int, admission: str | None = None) -> KVStrataConfig:
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


def policy_spec(cfg: KVStrataConfig) -> PolicySpec:
    """The policy a deployment of ``cfg`` runs (blocks of ``cfg.block_nbytes()``)."""
    nbytes = cfg.block_nbytes()
    return deployment_spec(cfg, block_nbytes=nbytes, gpu_blocks=cfg.gpu.resolve_num_blocks(nbytes))


def tier_capacities(cfg: KVStrataConfig) -> dict[str, int]:
    """Blocks each tier holds under ``cfg``: the device pool, then each lower tier the policy
    names (:meth:`PolicySpec.capacity`: every built-in local kind, 0 when off, then the
    deployment's others)."""
    return {GPU: cfg.gpu.resolve_num_blocks(cfg.block_nbytes()), **policy_spec(cfg).capacity()}
