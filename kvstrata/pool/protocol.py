"""What drivers need of a device pool: one protocol, whoever owns the pool.

* :class:`DevicePool`: what the driver core's step protocol reads of any device pool
  (:meth:`~kvstrata.core.driver.DriverCore.end_step`): the blocks it evicted since the last
  step, with their keys, and the page-out window. kvstrata's own pools
  (:class:`~kvstrata.pool.blocks.BlockManager`,
  :class:`~kvstrata.pool.grouped.GroupedBlockManager`) and the vLLM connector's view of
  vLLM's pool (:class:`~kvstrata.connectors.vllm.pool.PoolView`) are each one.
* :class:`BlockPool`: a device pool kvstrata owns (the library's and the replay's): prefix
  lookups and block tables for a prompt's KV-cache groups (``key(g, i)``: group ``g``'s key
  of block ``i``; one full-attention group's are the prompt's hashes).
* :class:`SteppedPool`: a block pool stepped as vLLM's scheduler steps a request alone
  (prefill chunks, decode steps), as the replay drives it.

:func:`stepped_pool` is the one rule that picks the pool for a model's groups.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from kvstrata.identity.groups import KVGroups
from kvstrata.identity.hashing import BlockHasher
from kvstrata.pool.blocks import Allocation, Prompt
from kvstrata.pool.free_queue import Block

__all__ = ["DevicePool", "BlockPool", "SteppedPool", "Key", "Stored", "stepped_pool", "pool_over_rows"]

Key = Callable[[int, int], bytes]  # (group, position) -> the group's key of that block
Stored = Callable[[int, int], bool]  # (group, position) -> do the tiers below keep that block
Blocks = list[tuple[int, bytes]]  # (device block, key)


@runtime_checkable
class DevicePool(Protocol):
    """What the driver core reads of a device pool at the end of each step."""

    def take_evicted(self) -> Blocks:
        """``(block, key)`` of the cached blocks handed out again since the last call, in order
        (their rows are intact until the step's writes)."""
        ...

    def free_window(self, n: int) -> Blocks:
        """``(block, key)`` of the cached blocks among the ``n`` the pool evicts next."""
        ...


@runtime_checkable
class BlockPool(DevicePool, Protocol):
    """A device pool kvstrata owns: rows ``blocks``, the cached keys, per-request block tables."""

    block_size: int
    blocks: Sequence[Block]
    cached: Mapping[bytes, Any]
    requests: Mapping[str, Any]

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_cached_blocks(self) -> int: ...

    def lookup(self, prompt: Prompt, key: Key) -> int:
        """How many leading blocks of ``prompt`` the pool serves, in every group. Pure."""
        ...

    def blocks_needed(self, prompt: Prompt) -> int:
        """Rows ``prompt`` takes without a hit."""
        ...

    def allocate(self, request_id: str, *, prompt: Prompt, key: Key, num_external: int = 0,
                 num_blocks: int | None = None, prefill: int | None = None, stored: Stored | None = None
                 ) -> Allocation:
        """Block tables (``Allocation.tables``, one per group): the pool's hit, then
        ``num_external`` blocks to load (registered), then new ones. Raises
        :class:`~kvstrata.errors.OutOfBlocksError` with nothing changed."""
        ...

    def commit(self, request_id: str) -> Blocks:
        """What the request computed so far is written: ``(block, key)`` registered, to offer below."""
        ...

    def invalidate(self, request_id: str, position: int) -> None:
        """The request's blocks from ``position`` on hold no KV (a failed load)."""
        ...

    def free(self, request_id: str) -> None: ...

    def evict_cached(self, block: Block) -> None:
        """Forget ``block``'s key (its bytes are stale)."""
        ...

    def resident(self) -> Blocks:
        """``(block, key)`` of every cached block, most recently used first."""
        ...


@runtime_checkable
class SteppedPool(BlockPool, Protocol):
    """A block pool stepped as vLLM's scheduler steps a request alone (as the replay drives it)."""

    def grow(self, request_id: str) -> list[int]:
        """After a load: the blocks of the prefill's first chunk after what was served."""
        ...

    def advance(self, request_id: str) -> bool:
        """The prefill's next chunk, a step of its own; False once the prefill is done."""
        ...

    def decode_steps(self, request_id: str) -> list[int]:
        """The decode steps at which the pool changes (tokens computed before each)."""
        ...

    def decode(self, request_id: str, t: int) -> Blocks:
        """The decode step computing token ``t``: what it registered, as :meth:`commit`."""
        ...


def stepped_pool(num_blocks: int, groups: KVGroups, *, budget: int | None = None,
                 track_evictions: bool = True) -> SteppedPool:
    """The pool of ``num_blocks`` rows for a model of ``groups`` (``budget``: the engine's
    tokens per step): the plain pool for one full-attention group (a block a row, keys the
    chain's), the grouped one (vLLM's hybrid allocator, row 0 its null block) otherwise."""
    if groups.plain:
        from kvstrata.pool.stepped import SteppedBlockManager

        return SteppedBlockManager(num_blocks, groups, track_evictions=track_evictions, budget=budget)
    from kvstrata.pool.grouped import GroupedBlockManager

    return GroupedBlockManager(num_blocks, groups, track_evictions=track_evictions, budget=budget)


def pool_over_rows(rows: int, groups: KVGroups, *, hasher: "BlockHasher | None" = None) -> SteppedPool:
    """The pool over ``rows`` device rows that exist (a library's KV pool), each prefill
    computed at once: every row a block with one full-attention group (keys hashed by
    ``hasher``); the grouped pool keeps row 0 as its null block and hands out the others."""
    if groups.plain:
        from kvstrata.pool.stepped import SteppedBlockManager

        return SteppedBlockManager(rows, groups, track_evictions=True, hasher=hasher)
    if rows < 2:
        raise ValueError(f"rows: a pool of KV-cache groups needs at least 2 rows (row 0 is its null block), got {rows}")
    return stepped_pool(rows - 1, groups)
