"""What the scheduler half sees of vLLM's GPU block pool.

vLLM owns the pool; kvstrata observes it through the pool's metrics hook (a
collector that forwards to vLLM's own, if any): ``on_block_evicted`` sees a
block while it still carries its hash. A prefix-cache reset is not an
eviction: those blocks are not stored (the reset may follow a weight update).
:class:`PoolView` turns what the hook saw into the driver core's terms: blocks
evicted this step (with kvstrata's keys), blocks handed out again, and the head
of the free queue (the page-out window).

Threads: vLLM's scheduler thread only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstrata.connectors.kit.resident import ResidentMap
from kvstrata.connectors.vllm.common import KVStrataMetadata

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool

__all__ = ["PoolObserver", "PoolView"]


class PoolObserver:
    """vLLM block pool's metrics collector hook: records which blocks lose their hash
    (evicted) or are handed out again, then forwards to vLLM's own collector."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.evicted: list[int] = []     # block ids that were hashed when popped, in order
        self.reassigned: list[int] = []  # block ids handed out again
        self.cleared = False             # the prefix cache was reset

    @property
    def sample_rate(self) -> float:
        return self.inner.sample_rate if self.inner is not None else 0.01

    def on_block_evicted(self, block: Any) -> None:
        if block.block_hash is not None:
            self.evicted.append(block.block_id)
        if self.inner is not None:
            self.inner.on_block_evicted(block)

    def on_block_allocated(self, block: Any) -> None:
        self.reassigned.append(block.block_id)
        if self.inner is not None:
            self.inner.on_block_allocated(block)

    def on_block_accessed(self, block: Any) -> None:
        if self.inner is not None:
            self.inner.on_block_accessed(block)

    def reset(self) -> None:
        self.cleared = True
        self.evicted.clear()  # a reset is not an eviction; blocks handed out stay listed (the fence)
        if self.inner is not None:
            self.inner.reset()

    def drain_events(self) -> list[Any]:
        return self.inner.drain_events() if self.inner is not None else []

    def __getattr__(self, name: str) -> Any:
        if self.inner is None:
            raise AttributeError(name)
        return getattr(self.inner, name)


class PoolView:
    """vLLM's pool with kvstrata's keys: ``resident`` maps its hashed blocks to keys (the
    workers' hot-set mirrors follow it when ``record``)."""

    def __init__(self, record: bool) -> None:
        self.resident = ResidentMap(record=record)
        self._observer: PoolObserver | None = None
        self._pool: BlockPool | None = None

    def bind(self, pool: "BlockPool") -> None:
        """Observe ``pool``'s evictions (needed by ``on_evict`` admission and the shutdown mirror)."""
        self._pool = pool
        if not isinstance(pool.metrics_collector, PoolObserver):
            pool.metrics_collector = PoolObserver(pool.metrics_collector)
        self._observer = pool.metrics_collector

    def take_changes(self, meta: KVStrataMetadata) -> list[tuple[int, bytes]]:
        """Blocks vLLM evicted since the last step (with their keys); updates the resident map
        and tells the workers which blocks were handed out again (``meta.reused``)."""
        obs = self._observer
        if obs is None:
            return []
        meta.reused = list(obs.reassigned)
        if obs.cleared:
            obs.cleared = False
            self.resident.clear()
        blocks = self.resident.blocks
        evicted = [(b, blocks[b]) for b in obs.evicted if b in blocks]
        for block_id in obs.reassigned:
            self.resident.drop(block_id)
        obs.evicted, obs.reassigned = [], []
        return evicted

    def cached_as(self, block_id: int, group: int, vhash: Any) -> bool:
        """Does vLLM hold block ``block_id`` cached as KV-cache group ``group``'s block whose
        hash is ``vhash``? (A state group's block holds the state at its position only then.)"""
        if self._pool is None:
            return False
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        return self._pool.blocks[block_id].block_hash == make_block_hash_with_group_id(vhash, group)

    def free_window(self, n: int) -> list[tuple[int, bytes]]:
        """The hashed blocks among the ``n`` vLLM evicts next (the head of its free queue)."""
        if self._pool is None:
            return []
        queue = self._pool.free_block_queue
        block = queue.fake_free_list_head.next_free_block
        tail = queue.fake_free_list_tail
        out = []
        for _ in range(n):
            if block is None or block is tail:
                break
            key = self.resident.blocks.get(block.block_id) if block.block_hash is not None else None
            if key is not None:
                out.append((block.block_id, key))
            block = block.next_free_block
        return out
