"""The SSD tiers of an engine's ranks, read from the process that schedules them.

A worker opens its own SSD tier (through the deployment builder: ``rank-<r>`` under
``ssd.path``). LMDB allows one handle per process, so the scheduler, when it runs in the same
process, reads a tier's keys and tags through the handle the worker holds
(:func:`kvstrata.tiers.ssd.kind.held_open`); otherwise it reads them beside the owner,
read-only, in a child process (:func:`~kvstrata.tiers.ssd.tier.read_keys`).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from kvstrata.config.schema import KVStrataConfig
from kvstrata.errors import ConfigError
from kvstrata.identity.fingerprint import Fingerprint
from kvstrata.identity.ranks import Rank
from kvstrata.tiers.ssd import SSDTier
from kvstrata.tiers.ssd.kind import held_open, ssd_root
from kvstrata.tiers.ssd.tier import read_keys, read_tags

__all__ = ["recovering_ssd_tiers", "read_ssd_keys", "read_ssd_tags"]

log = logging.getLogger(__name__)

def recovering_ssd_tiers(cfg: KVStrataConfig, ranks: Sequence[Rank]) -> list[SSDTier]:
    """The SSD tiers of ``ranks`` open in this process whose background recovery is not
    over: :func:`read_ssd_keys` gets none of their keys yet."""
    root = ssd_root(cfg)
    tiers = [held_open(rank.ssd_dir(root)) for rank in ranks]
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
        tier = held_open(path)
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
    tier = held_open(path)
    if tier is None:
        return read_tags(path, rank.tier_id(fingerprint))
    tier.wait_ready()
    return tier.tags()
