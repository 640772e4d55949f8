"""The SSD tiers the workers of this process opened, and reading them from the scheduler half.

A worker opens its own SSD tier (:func:`open_ssd_tier`, in ``rank-<r>`` under
``ssd.path``). LMDB allows one handle per process, so the scheduler half, when it
runs in the same process, reads a tier's keys and tags through the worker's handle
(kept here by path); otherwise it reads them beside the owner, read-only, in a
child process (:func:`~kvstrata.tiers.ssd.tier.read_keys`).

Threads: the registry is written by worker threads and read by the scheduler's;
single dict operations (atomic under the GIL).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from kvstrata.config.schema import SSD_TIER_KEYS, KVStrataConfig
from kvstrata.errors import ConfigError, config_keys
from kvstrata.identity.fingerprint import Fingerprint
from kvstrata.tiers.ssd import SSDTier
from kvstrata.tiers.ssd.tier import read_keys, read_tags

from kvstrata.connectors.kit.ranks import Rank, ssd_root

__all__ = ["open_ssd_tier", "forget_ssd_tier", "recovering_ssd_tiers", "read_ssd_keys", "read_ssd_tags"]

log = logging.getLogger(__name__)

_OPEN: dict[str, SSDTier] = {}  # path -> a tier a worker of this process opened


def open_ssd_tier(cfg: KVStrataConfig, fingerprint: Fingerprint, rank: Rank, block_nbytes: int) -> SSDTier:
    """The SSD tier of one worker, in its own directory under ``ssd.path``."""
    root = ssd_root(cfg)
    if rank.index == 0 and (root / "data.mdb").exists():
        log.warning("kvstrata: %s holds an SSD tier of the layout before per-rank directories; "
                    "it is no longer read (each worker uses %s/rank-<r>): delete its files to "
                    "free the space", root, root)
    path = rank.ssd_dir(root)
    with config_keys(SSD_TIER_KEYS):
        tier = SSDTier(path, capacity_bytes=cfg.ssd.capacity, fingerprint=rank.tier_id(fingerprint),
                       compression=cfg.ssd.compression, level=cfg.ssd.level,
                       queue_capacity_bytes=cfg.ssd.queue_capacity, block_nbytes=block_nbytes)
    _OPEN[str(path)] = tier
    return tier


def recovering_ssd_tiers(cfg: KVStrataConfig, ranks: Sequence[Rank]) -> list[SSDTier]:
    """The SSD tiers of ``ranks`` open in this process whose background recovery is not
    over: :func:`read_ssd_keys` gets none of their keys yet."""
    root = ssd_root(cfg)
    tiers = [_OPEN.get(str(rank.ssd_dir(root))) for rank in ranks]
    return [tier for tier in tiers if tier is not None and tier.recovering()]


def read_ssd_keys(cfg: KVStrataConfig, fingerprint: Fingerprint, ranks: Sequence[Rank]
                  ) -> tuple[list[bytes], list[bytes]]:
    """The blocks on SSD at start-up: ``(whole, partial)``. ``whole``: keys every rank's
    tier holds, least recently used first (by rank 0); ``partial``: keys only some hold
    (a crash between the ranks' writes), to delete. Read once, from the tiers the
    workers own: in this process through the worker's tier, otherwise beside it
    (read-only, in a child process). A tier that cannot be read yields none (misses
    only) and deletes nothing."""
    root = ssd_root(cfg)

    def keys_of(rank: Rank) -> list[bytes]:
        path = rank.ssd_dir(root)
        tier = _OPEN.get(str(path))
        return list(tier.keys()) if tier is not None else read_keys(path, rank.tier_id(fingerprint))

    try:
        with ThreadPoolExecutor(min(len(ranks), 8), thread_name_prefix="kvstrata-keys") as pool:
            per_rank = list(pool.map(keys_of, ranks))  # the ranks' reader processes at once
    except (OSError, ConfigError) as exc:  # a broken tier costs hits, never the engine
        log.warning("kvstrata: cannot read the SSD tiers under %s (%s); starting with none of "
                    "their blocks", root, exc)
        return [], []
    if len(per_rank) == 1:
        return per_rank[0], []
    common = set(per_rank[0]).intersection(*per_rank[1:])
    whole = [k for k in per_rank[0] if k in common]
    partial = list(dict.fromkeys(k for keys in per_rank for k in keys if k not in common))
    return whole, partial


def read_ssd_tags(cfg: KVStrataConfig, fingerprint: Fingerprint, rank: Rank) -> dict[bytes, bytes]:
    """The tags kept beside the records of ``rank``'s SSD tier (key -> tag), read as
    :func:`read_ssd_keys` reads keys; a tier of this process that recovers in the background
    is waited for (the caller's thread blocks: not the scheduler's). Raises ``OSError`` when
    they cannot be read."""
    path = rank.ssd_dir(ssd_root(cfg))
    tier = _OPEN.get(str(path))
    if tier is None:
        return read_tags(path, rank.tier_id(fingerprint))
    tier.wait_ready()
    return tier.tags()


def forget_ssd_tier(tier: SSDTier) -> None:
    """A worker closed ``tier``."""
    _OPEN.pop(str(tier.path), None)
