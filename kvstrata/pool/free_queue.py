"""The pool's rows and their LRU free queue.

* ``Block``: one preallocated, slotted object per row of the KV pool, carrying
  ``block_id``, ``block_hash``, ``ref_cnt`` and its own free-queue links.
* ``FreeBlockQueue``: an intrusive doubly linked list in LRU order. Head = next
  to evict, tail = most recently freed. popleft / append / remove are O(1) and
  allocate nothing.

Threads: owned by the block manager's one thread.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from kvstrata.errors import OutOfBlocksError

__all__ = ["Block", "FreeBlockQueue"]


class Block:
    """One row of the KV pool. Lives for the lifetime of the pool."""

    __slots__ = ("block_id", "block_hash", "ref_cnt", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.block_hash: bytes | None = None
        self.ref_cnt = 0
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"Block(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks (head = least recently freed)."""

    __slots__ = ("_head", "_tail", "num_free")

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._head = Block(-1)  # sentinels: no branches for empty/edge cases
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> Block:
        block = self._head.next_free
        if block is self._tail:
            raise OutOfBlocksError("no free blocks")
        assert block is not None
        self.remove(block)
        return block

    def extend(self, blocks: list[Block]) -> None:
        """:meth:`append` each block in turn (one relinking pass)."""
        if not blocks:
            return
        prev = self._tail.prev_free
        for block in blocks:
            prev.next_free = block  # type: ignore[union-attr]
            block.prev_free = prev
            prev = block
        prev.next_free = self._tail
        self._tail.prev_free = prev
        self.num_free += len(blocks)

    def appendleft(self, block: Block) -> None:
        """Put ``block`` at the head (next to be reused)."""
        first = self._head.next_free
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block  # type: ignore[union-attr]
        self.num_free += 1

    def reversed(self) -> Iterator[Block]:
        """Free blocks most recently freed first."""
        block = self._tail.prev_free
        while block is not self._head:
            assert block is not None
            yield block
            block = block.prev_free

    def hashed_head(self, n: int) -> list[tuple[int, bytes]]:
        """``(block_id, hash)`` of the hashed blocks among the ``n`` next to be reused (the
        page-out window)."""
        out = []
        for i, b in enumerate(self):
            if i >= n:
                break
            if b.block_hash is not None:
                out.append((b.block_id, b.block_hash))
        return out

    def peek(self) -> Block | None:
        block = self._head.next_free
        return None if block is self._tail else block

    # append/remove are the hot path: no checks here (a block's links say whether it is
    # queued; the state-machine tests verify the queue against a reference model).
    def append(self, block: Block) -> None:
        last = self._tail.prev_free
        last.next_free = block  # type: ignore[union-attr]
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        prev.next_free = nxt  # type: ignore[union-attr]
        nxt.prev_free = prev  # type: ignore[union-attr]
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self) -> Iterator[Block]:
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free
