"""Ranks: one worker's place in an engine's parallel layout, and the identity of the blocks it
holds (its shard of a block's KV). Engine-neutral: an adapter builds the ranks from its engine's
parallel config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvstrata.identity.fingerprint import Fingerprint

__all__ = ["Rank"]


@dataclass(frozen=True)
class Rank:
    """One worker of an engine: its place in the parallel layout. Each has an SSD tier of
    its own, in ``rank-<index>`` under ``ssd.path`` (a tier directory has one owner)."""

    tp: int
    pp: int
    dp: int
    tp_size: int
    pp_size: int

    @property
    def index(self) -> int:
        """The worker's global rank: data-parallel engine, then pipeline stage, then shard."""
        return (self.dp * self.pp_size + self.pp) * self.tp_size + self.tp

    def directory(self, root: Path) -> Path:
        """This rank's own directory under ``root`` (``rank-<index>``: a per-rank tier's)."""
        return root / f"rank-{self.index}"

    def tier_id(self, fingerprint: Fingerprint) -> str:
        return fingerprint.tier_id(self.tp, self.pp)
