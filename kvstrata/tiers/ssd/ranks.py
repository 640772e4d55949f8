"""The SSD tiers of an engine's ranks as the process that schedules them reads them: the records
they kept from before this start (their keys, the tags beside them), never a write.

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
from kvstrata.policy.tiers import SSD
from kvstrata.tiers.ssd.kind import held_open, ssd_root
from kvstrata.tiers.ssd.tier import SSDTier, read_keys, read_tags

__all__ = ["RankRecords", "rank_records"]

log = logging.getLogger(__name__)


def rank_records(cfg: KVStrataConfig, store_tier: str, fingerprint: Fingerprint, ranks: Sequence[Rank]
                 ) -> "RankRecords | None":
    """The records of the ranks' persistent tier when it (``store_tier``, as the policy names it)
    is the SSD tier; None otherwise (no other kind keeps records its scheduler reads)."""
    return RankRecords(cfg, fingerprint, ranks) if store_tier == SSD else None


class RankRecords:
    """The records the SSD tiers of ``ranks`` (under ``ssd.path`` of ``cfg``) hold from before
    this start, of blocks compatible with ``fingerprint``."""

    def __init__(self, cfg: KVStrataConfig, fingerprint: Fingerprint, ranks: Sequence[Rank]) -> None:
        self.cfg = cfg
        self.fingerprint = fingerprint
        self.ranks = list(ranks)

    def recovering(self) -> list[SSDTier]:
        """The ranks' tiers open in this process whose background recovery is not over:
        :meth:`keys` gets none of their keys yet."""
        root = ssd_root(self.cfg)
        tiers = [held_open(rank.directory(root)) for rank in self.ranks]
        return [tier for tier in tiers if tier is not None and tier.recovering()]

    def keys(self) -> tuple[list[bytes], list[bytes]]:
        """The blocks on SSD at start-up: ``(whole, partial)``. ``whole``: keys every rank's
        tier holds, least recently used first (by rank 0); ``partial``: keys only some hold
        (a crash between the ranks' writes), to delete. Read once, from the tiers the
        workers own: in this process through the worker's tier, otherwise beside it
        (read-only, in a child process). A tier that cannot be read yields none (misses
        only) and deletes nothing."""
        root = ssd_root(self.cfg)

        def keys_of(rank: Rank) -> list[bytes]:
            path = rank.directory(root)
            tier = held_open(path)
            return list(tier.keys()) if tier is not None else read_keys(path, rank.tier_id(self.fingerprint))

        try:
            with ThreadPoolExecutor(min(len(self.ranks), 8), thread_name_prefix="kvstrata-keys") as pool:
                per_rank = list(pool.map(keys_of, self.ranks))  # the ranks' reader processes at once
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

    def tags(self) -> dict[bytes, bytes]:
        """The tags kept beside the records of rank 0's tier (key -> tag), read as :meth:`keys`
        reads keys; a tier of this process that recovers in the background is waited for (the
        caller's thread blocks: not the scheduler's). Raises ``OSError`` when they cannot be
        read."""
        rank = self.ranks[0]
        path = rank.directory(ssd_root(self.cfg))
        tier = held_open(path)
        if tier is None:
            return read_tags(path, rank.tier_id(self.fingerprint))
        tier.wait_ready()
        return tier.tags()
