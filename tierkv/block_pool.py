"""The paged block pool and the request-level block manager.

Structures (the seed's section 6.2):

* ``Block``: one preallocated, slotted object per row of the KV pool, carrying
  ``block_id``, ``block_hash``, ``ref_cnt`` and its own free-queue links.
* ``FreeBlockQueue``: an intrusive doubly linked list in LRU order. Head = next
  to evict, tail = most recently freed. popleft / append / remove are O(1) and
  allocate nothing.
* the hash -> block map (``BlockManager.cached``) for prefix lookups.
* per-request block tables.

``ref_cnt`` and ``block_hash`` are independent: a freed block keeps its hash and
content until it is popped for reuse, which is what makes prefix hits (and, in
the tiered cache, spills) possible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from tierkv.errors import OutOfBlocksError
from tierkv.hashing import BlockHasher

__all__ = ["Block", "FreeBlockQueue", "BlockManager", "Allocation", "ExternalHit"]

# (position in the prompt, block hash) -> does a lower tier hold this block?
ExternalHit = Callable[[int, bytes], bool]


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


@dataclass
class Allocation:
    """Result of :meth:`BlockManager.allocate`.

    ``block_ids`` is the request's block table. The first ``num_cached_tokens``
    tokens need no prefill: ``num_gpu_hit_blocks`` blocks were found in the pool,
    and the ``external`` blocks (``(position, block_id, block_hash)``) were
    reported by a lower tier and must be loaded into their new rows first.
    """

    block_ids: list[int]
    num_cached_tokens: int
    num_gpu_hit_blocks: int = 0
    external: list[tuple[int, int, bytes]] = field(default_factory=list)


class _Request:
    __slots__ = ("tokens", "blocks", "hashes", "cache_salt", "lora_id", "num_tokens")

    def __init__(self, tokens: list[int] | None, num_tokens: int, blocks: list[Block], hashes: list[bytes],
                 cache_salt: str | bytes | None, lora_id: str | bytes | int | None) -> None:
        self.tokens = tokens
        self.num_tokens = num_tokens
        self.blocks = blocks
        self.hashes = hashes
        self.cache_salt = cache_salt
        self.lora_id = lora_id


class BlockManager:
    """Request-level allocation over a pool of ``num_blocks`` rows with prefix caching.

    ``on_evict(block_id, block_hash)`` is called when a free block that still
    carries a hash is popped for reuse, before it is handed out: the last moment
    its bytes are intact (the tiered cache spills it there).
    """

    def __init__(self, num_blocks: int, block_size: int, *, hasher: BlockHasher | None = None,
                 on_evict: Callable[[int, bytes], None] | None = None) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks: expected a positive integer, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: expected a positive integer, got {block_size!r}")
        if hasher is not None and hasher.block_size != block_size:
            raise ValueError(f"hasher: block_size {hasher.block_size} != block_size {block_size}")
        self.block_size = block_size
        self.hasher = hasher or BlockHasher(block_size)
        self.on_evict = on_evict
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.requests: dict[str, _Request] = {}

    # ----------------------------------------------------------------- queries

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._request(request_id).blocks]

    def block_hashes(self, request_id: str) -> list[bytes]:
        """Digests of the request's full blocks, in order."""
        return list(self._request(request_id).hashes)

    def num_tokens(self, request_id: str) -> int:
        return self._request(request_id).num_tokens

    # ---------------------------------------------------------------- requests

    def allocate(self, request_id: str, token_ids: Sequence[int] | None = None, *,
                 block_hashes: Sequence[bytes] | None = None, num_tokens: int | None = None,
                 cache_salt: str | bytes | None = None, lora_id: str | bytes | int | None = None,
                 external_hit: ExternalHit | None = None) -> Allocation:
        """Give a new request its block table, reusing cached prefix blocks.

        Pass ``token_ids``, or precomputed full-block ``block_hashes`` (then
        ``num_tokens`` defaults to ``len(block_hashes) * block_size``). At most
        ``(num_tokens - 1) // block_size`` blocks hit: the last prompt token is
        always computed; hashes given without ``num_tokens`` may all hit (a
        trace that names its blocks says nothing of the tokens after them). The walk stops at the first block that neither the pool
        nor ``external_hit`` holds. Raises :class:`OutOfBlocksError` with nothing
        changed when too few blocks are free.
        """
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already allocated")
        tokens, hashes, n = self._prompt(token_ids, block_hashes, num_tokens, cache_salt, lora_id)
        # the last prompt token is always computed, unless precomputed hashes came without a token count
        cap = len(hashes) if token_ids is None and num_tokens is None else min((n - 1) // self.block_size,
                                                                              len(hashes))
        walk = self._walk(hashes, cap, external_hit)
        hits = [b for b in walk if b is not None]
        num_total = -(-n // self.block_size)
        num_new = num_total - len(hits)
        reusable = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new > self.free_queue.num_free - reusable:
            raise OutOfBlocksError(
                f"request {request_id!r} needs {num_new} new blocks, {self.free_queue.num_free - reusable} free")
        for b in hits:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1
        blocks: list[Block] = []
        external: list[tuple[int, int, bytes]] = []
        for pos in range(num_total):
            b = walk[pos] if pos < len(walk) else None
            if b is None:
                b = self._pop()
                if pos < len(walk):
                    external.append((pos, b.block_id, hashes[pos]))
                if pos < len(hashes):
                    self._register(b, hashes[pos])
            blocks.append(b)
        self.requests[request_id] = _Request(tokens, n, blocks, hashes, cache_salt, lora_id)
        return Allocation([b.block_id for b in blocks], len(walk) * self.block_size, len(hits), external)

    def append(self, request_id: str, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Append tokens to a request; return copy-on-write ops ``(src, dst)`` to perform.

        A partial, shared last block is copied on write before new tokens land in
        it. Blocks that become full are hashed (continuing the chain) and
        registered. Raises :class:`OutOfBlocksError` with nothing changed.
        """
        req = self._request(request_id)
        if req.tokens is None:
            raise ValueError(f"request_id: {request_id!r} was allocated from block hashes; it has no tokens to extend")
        new = list(token_ids)
        if not new:
            return []
        bs = self.block_size
        old_n = req.num_tokens
        cow = old_n % bs != 0 and req.blocks[-1].ref_cnt > 1
        num_new_blocks = -(-(old_n + len(new)) // bs) - len(req.blocks)
        if num_new_blocks + cow > self.free_queue.num_free:
            raise OutOfBlocksError(f"request {request_id!r} needs {num_new_blocks + cow} new blocks, "
                                   f"{self.free_queue.num_free} free")
        ops: list[tuple[int, int]] = []
        if cow:
            old = req.blocks[-1]
            fresh = self._pop()
            ops.append((old.block_id, fresh.block_id))
            req.blocks[-1] = fresh
            old.ref_cnt -= 1
        for _ in range(num_new_blocks):
            req.blocks.append(self._pop())
        req.tokens.extend(new)
        req.num_tokens = len(req.tokens)
        first_new_full = len(req.hashes)
        self.hasher.extend(req.hashes, req.tokens, cache_salt=req.cache_salt, lora_id=req.lora_id)
        for i in range(first_new_full, len(req.hashes)):
            self._register(req.blocks[i], req.hashes[i])
        return ops

    def fork(self, parent_request_id: str, child_request_id: str) -> None:
        """Share the parent's blocks with a new child request (n > 1 sampling)."""
        parent = self._request(parent_request_id)
        if child_request_id in self.requests:
            raise ValueError(f"child_request_id: {child_request_id!r} is already allocated")
        for b in parent.blocks:
            b.ref_cnt += 1
        tokens = list(parent.tokens) if parent.tokens is not None else None
        self.requests[child_request_id] = _Request(tokens, parent.num_tokens, list(parent.blocks),
                                                   list(parent.hashes), parent.cache_salt, parent.lora_id)

    def free(self, request_id: str) -> None:
        """Release a request. Blocks reaching ref_cnt 0 join the free queue's tail,
        last block first, keeping content and hash (so the prompt's first block is
        the last of them to be evicted)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            raise ValueError(f"request_id: {request_id!r} is not allocated")
        for b in reversed(req.blocks):
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"{b}: ref_cnt below zero"
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    def evict_cached(self, block: Block) -> None:
        """Drop a free block's hash (its bytes become garbage)."""
        h = block.block_hash
        if h is None:
            return
        block.block_hash = None
        if self.cached.get(h) is block:
            del self.cached[h]

    # --------------------------------------------------------------- internals

    def _request(self, request_id: str) -> _Request:
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"request_id: {request_id!r} is not allocated")
        return req

    def _prompt(self, token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None,
                num_tokens: int | None, cache_salt: str | bytes | None,
                lora_id: str | bytes | int | None) -> tuple[list[int] | None, list[bytes], int]:
        if (token_ids is None) == (block_hashes is None):
            raise ValueError("token_ids/block_hashes: pass exactly one of them")
        if token_ids is not None:
            tokens = list(token_ids)
            if not tokens:
                raise ValueError("token_ids: a request needs at least one token")
            return tokens, self.hasher.hash_blocks(tokens, cache_salt=cache_salt, lora_id=lora_id), len(tokens)
        hashes = list(block_hashes)  # type: ignore[arg-type]
        if len(set(hashes)) != len(hashes):
            raise ValueError("block_hashes: the same hash appears twice in one request")
        n = len(hashes) * self.block_size if num_tokens is None else num_tokens
        if n < 1 or n < len(hashes) * self.block_size - (self.block_size - 1) or not all(
                isinstance(h, bytes) for h in hashes):
            raise ValueError(f"block_hashes/num_tokens: {len(hashes)} full block hashes do not fit "
                             f"{n} tokens of block size {self.block_size} (or a hash is not bytes)")
        return None, hashes[: n // self.block_size], n

    def _walk(self, hashes: Sequence[bytes], cap: int, external_hit: ExternalHit | None) -> list[Block | None]:
        """Blocks of the cached prefix: a pool Block, or None for an external hit."""
        out: list[Block | None] = []
        cached = self.cached
        for pos in range(cap):
            b = cached.get(hashes[pos])
            if b is None and not (external_hit is not None and external_hit(pos, hashes[pos])):
                break
            out.append(b)
        return out

    def _pop(self) -> Block:
        b = self.free_queue.popleft()
        if b.block_hash is not None:
            h = b.block_hash
            self.evict_cached(b)
            if self.on_evict is not None:
                self.on_evict(b.block_id, h)
        b.ref_cnt = 1
        return b

    def _register(self, block: Block, block_hash: bytes) -> None:
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            block.block_hash = block_hash
