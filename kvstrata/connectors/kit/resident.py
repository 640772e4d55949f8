"""The resident map: which device blocks hold which block keys, and its changes since the last
look (what a scheduler tells its workers so that a shutdown can store what the device holds).
Engine-neutral: an adapter adds and drops blocks as its engine's pool assigns them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from collections import OrderedDict

__all__ = ["ResidentDelta", "ResidentMap"]


@dataclass
class ResidentDelta:
    """Changes to the hashed GPU blocks since the last step, in the order to apply them:
    ``cleared`` (all dropped), ``dropped`` block ids, ``added`` ``(block id, key)``,
    ``used`` block ids (most recently used last). Built by :class:`ResidentMap`, which
    sends only additions still resident, so that this order is always right."""

    cleared: bool = False
    dropped: list[int] = field(default_factory=list)
    added: list[tuple[int, bytes]] = field(default_factory=list)
    used: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.cleared or self.dropped or self.added or self.used)

    def apply(self, mirror: "OrderedDict[int, bytes]") -> None:
        """Bring a worker's mirror (block id -> key, least recently used first) up to date."""
        if self.cleared:
            mirror.clear()
        for block_id in self.dropped:
            mirror.pop(block_id, None)
        for block_id, key in self.added:
            mirror[block_id] = key
            mirror.move_to_end(block_id)
        for block_id in self.used:
            if block_id in mirror:
                mirror.move_to_end(block_id)


class ResidentMap:
    """The scheduler's map of vLLM block id -> key for hashed blocks whose KV is ours, and
    the :class:`ResidentDelta` the workers' mirrors need to follow it."""

    def __init__(self, record: bool = True) -> None:
        self.blocks: dict[int, bytes] = {}
        self.record = record  # False: no worker keeps a mirror (no SSD tier), nothing to send
        self._delta = ResidentDelta()

    def add(self, block_ids: Sequence[int], keys: Sequence[bytes]) -> None:
        for block_id, key in zip(block_ids, keys):
            self.blocks[block_id] = key
        if self.record:
            self._delta.added.extend(zip(block_ids, keys))

    def drop(self, block_id: int) -> bool:
        """Forget a block (vLLM reassigned it); True if it was ours."""
        if self.blocks.pop(block_id, None) is None:
            return False
        if self.record:
            self._delta.dropped.append(block_id)
        return True

    def clear(self) -> None:
        self.blocks.clear()
        if self.record:
            self._delta = ResidentDelta(cleared=True)

    def used(self, block_ids: Sequence[int]) -> None:
        if self.record:
            self._delta.used.extend(block_ids)

    def take_delta(self) -> ResidentDelta:
        """The changes since the last call. A block added and then dropped (or added again
        under another key) in between is sent only as it is now."""
        delta, self._delta = self._delta, ResidentDelta()
        blocks = self.blocks
        delta.added = [(b, k) for b, k in delta.added if blocks.get(b) == k]
        return delta
