"""The paged block pool and the request-level block manager.

Structures (the seed's section 6.2):

* ``Block``, one per row of the KV pool, and the ``FreeBlockQueue`` of free
  rows in LRU order (:mod:`kvstrata.pool.free_queue`);
* the hash -> block map (``BlockManager.cached``) for prefix lookups.
* per-request block tables.

``ref_cnt`` and ``block_hash`` are independent: a freed block keeps its hash and
content until it is popped for reuse, which is what makes prefix hits (and, in
the tiered cache, spills) possible.

A block's hash is registered only once its KV is known to be valid: blocks
found in the pool or loaded from a lower tier at :meth:`BlockManager.allocate`,
newly computed blocks at :meth:`BlockManager.commit`. A request freed before it
committed (an abort) leaves nothing cached. Freed blocks without a hash go to
the head of the free queue (reused first), hashed ones to its tail, last block
first: the same order as vLLM's block pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from kvstrata.errors import OutOfBlocksError
from kvstrata.pool.free_queue import Block, FreeBlockQueue
from kvstrata.identity.hashing import BlockHasher

__all__ = ["Block", "FreeBlockQueue", "BlockManager", "Allocation", "Prompt", "make_prompt"]


@dataclass(slots=True)
class Prompt:
    """A prompt as the pool sees it: its full-block hashes and how many of them may hit.

    ``cap``: blocks that may be served from cache. The last prompt token is
    always computed, so ``(num_tokens - 1) // block_size``, except for hashes
    given without a token count (a trace that names its blocks says nothing of
    the tokens after them): then every named block may hit.
    """

    hashes: list[bytes]
    num_tokens: int
    cap: int
    tokens: list[int] | None = None
    cache_salt: str | bytes | None = None
    lora_id: str | bytes | int | None = None


def make_prompt(hasher: BlockHasher, token_ids: Sequence[int] | None = None, *,
                block_hashes: Sequence[bytes] | None = None, num_tokens: int | None = None,
                cache_salt: str | bytes | None = None, lora_id: str | bytes | int | None = None) -> Prompt:
    """A prompt from ``token_ids`` (hashed with ``hasher``), or from precomputed full-block
    ``block_hashes`` (``num_tokens`` defaults to ``len(block_hashes) * block_size``)."""
    bs = hasher.block_size
    if (token_ids is None) == (block_hashes is None):
        raise ValueError("token_ids/block_hashes: pass exactly one of them")
    if token_ids is not None:
        tokens = list(token_ids)
        if not tokens:
            raise ValueError("token_ids: a request needs at least one token")
        hashes = hasher.hash_blocks(tokens, cache_salt=cache_salt, lora_id=lora_id)
        hasher.check_tokens(tokens[len(hashes) * bs:])
        return Prompt(hashes, len(tokens), min((len(tokens) - 1) // bs, len(hashes)), tokens, cache_salt, lora_id)
    hashes = list(block_hashes)  # type: ignore[arg-type]
    size = hasher.digest_size
    bad = next((i for i, h in enumerate(hashes) if not isinstance(h, bytes) or len(h) != size), None)
    if bad is not None:
        h = hashes[bad]
        got = f"{len(h)} bytes" if isinstance(h, bytes) else type(h).__name__
        raise ValueError(f"block_hashes[{bad}]: expected {size} bytes (a {hasher.algo} block "
                         f"hash), got {got}")
    if len(set(hashes)) != len(hashes):
        raise ValueError("block_hashes: the same hash appears twice in one request")
    n = len(hashes) * bs if num_tokens is None else num_tokens
    if n < 1 or n < len(hashes) * bs - (bs - 1):
        raise ValueError(f"block_hashes/num_tokens: {len(hashes)} full block hashes do not fit "
                         f"{n} tokens of block size {bs}")
    hashes = hashes[: n // bs]
    cap = len(hashes) if num_tokens is None else min((n - 1) // bs, len(hashes))
    return Prompt(hashes, n, cap, None, cache_salt, lora_id)


@dataclass
class Allocation:
    """Result of :meth:`BlockManager.allocate`.

    ``block_ids`` is the request's block table (so far: see ``num_blocks``).
    The first ``num_cached_tokens`` tokens need no prefill:
    ``num_gpu_hit_blocks`` blocks were found in the pool, and the ``external``
    blocks (``(position, block_id, block_hash)``) come from a lower tier and
    must be loaded into their new rows first. ``tables``: the block table of each
    KV-cache group (the plain pool's one is ``block_ids``).
    """

    block_ids: list[Any]
    num_cached_tokens: int
    num_gpu_hit_blocks: int = 0
    external: list[tuple[int, int, bytes]] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)


class _Request:
    __slots__ = ("tokens", "blocks", "hashes", "cache_salt", "lora_id", "num_tokens", "committed")

    def __init__(self, prompt: Prompt, blocks: list[Block], cached: int = 0) -> None:
        self.tokens = prompt.tokens
        self.num_tokens = prompt.num_tokens
        self.blocks = blocks
        self.hashes = prompt.hashes
        self.cache_salt = prompt.cache_salt
        self.lora_id = prompt.lora_id
        self.committed = cached  # leading full blocks that are registered: served from cache, or committed


class BlockManager:
    """Request-level allocation over a pool of ``num_blocks`` rows with prefix caching.

    When a free block that still carries a hash is popped for reuse, before it
    is handed out (the last moment its bytes are known intact; a tiered cache
    stores it below then), ``(block_id, block_hash)`` is recorded for
    :meth:`take_evicted` when ``track_evictions`` is on, and ``on_evict(block_id,
    block_hash)`` is called when given.
    """

    def __init__(self, num_blocks: int, block_size: int, *, hasher: BlockHasher | None = None,
                 on_evict: Callable[[int, bytes], None] | None = None, track_evictions: bool = False) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks: expected a positive integer, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: expected a positive integer, got {block_size!r}")
        if hasher is not None and hasher.block_size != block_size:
            raise ValueError(f"hasher: block_size {hasher.block_size} != block_size {block_size}")
        self.block_size = block_size
        self.hasher = hasher or BlockHasher(block_size)
        self.on_evict = on_evict
        self._evicted: list[tuple[int, bytes]] | None = [] if track_evictions else None
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

    def prompt(self, token_ids: Sequence[int] | None = None, *, block_hashes: Sequence[bytes] | None = None,
               num_tokens: int | None = None, cache_salt: str | bytes | None = None,
               lora_id: str | bytes | int | None = None) -> Prompt:
        """Hash (or take) a prompt's full blocks (see :func:`make_prompt`)."""
        return make_prompt(self.hasher, token_ids, block_hashes=block_hashes, num_tokens=num_tokens,
                           cache_salt=cache_salt, lora_id=lora_id)

    def lookup(self, prompt: Prompt) -> int:
        """How many leading blocks of ``prompt`` the pool holds (at most ``prompt.cap``). Pure."""
        cached = self.cached
        hashes = prompt.hashes
        n = 0
        while n < prompt.cap and hashes[n] in cached:
            n += 1
        return n

    def blocks_needed(self, prompt: Prompt) -> int:
        return -(-prompt.num_tokens // self.block_size)

    # ---------------------------------------------------------------- requests

    def allocate(self, request_id: str, token_ids: Sequence[int] | None = None, *, prompt: Prompt | None = None,
                 block_hashes: Sequence[bytes] | None = None, num_tokens: int | None = None,
                 cache_salt: str | bytes | None = None, lora_id: str | bytes | int | None = None,
                 num_external: int = 0, num_blocks: int | None = None) -> Allocation:
        """Give a new request its block table, reusing cached prefix blocks.

        The prompt comes as ``token_ids``, ``block_hashes`` or a :class:`Prompt`
        from :meth:`prompt`. The pool's cached prefix (:meth:`lookup`) is reused;
        the next ``num_external`` blocks (held by a lower tier, at most up to the
        prompt's cap) get new blocks registered under their hashes, to be loaded.
        ``num_blocks``: hold only that many blocks now (at least the cached
        prefix); :meth:`grow` adds the rest. Raises :class:`OutOfBlocksError`
        with nothing changed when too few blocks are free.
        """
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already allocated")
        if prompt is None:
            prompt = self.prompt(token_ids, block_hashes=block_hashes, num_tokens=num_tokens,
                                 cache_salt=cache_salt, lora_id=lora_id)
        hashes = prompt.hashes
        hits = [self.cached[h] for h in hashes[:self.lookup(prompt)]]
        cached_blocks = min(len(hits) + max(0, num_external), prompt.cap)
        total = self.blocks_needed(prompt) if num_blocks is None else max(num_blocks, cached_blocks)
        reusable = sum(1 for b in hits if b.ref_cnt == 0)
        if total - len(hits) > self.free_queue.num_free - reusable:
            raise OutOfBlocksError(f"request {request_id!r} needs {total - len(hits)} new blocks, "
                                   f"{self.free_queue.num_free - reusable} free")
        for b in hits:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1
        blocks = hits + self._pop_many(total - len(hits))
        external: list[tuple[int, int, bytes]] = []
        for pos in range(len(hits), cached_blocks):
            b = blocks[pos]
            external.append((pos, b.block_id, hashes[pos]))
            self._register(b, hashes[pos])
        self.requests[request_id] = _Request(prompt, blocks, cached_blocks)
        ids = [b.block_id for b in blocks]
        return Allocation(ids, cached_blocks * self.block_size, len(hits), external, [ids])

    def grow(self, request_id: str, num_tokens: int | None = None) -> list[int]:
        """Add the blocks a request allocated with ``num_blocks`` still lacks for its first
        ``num_tokens`` tokens (all when None); returns their ids. Raises
        :class:`OutOfBlocksError` with nothing changed."""
        req = self._request(request_id)
        n = req.num_tokens if num_tokens is None else min(num_tokens, req.num_tokens)
        need = -(-n // self.block_size) - len(req.blocks)
        if need > self.free_queue.num_free:
            raise OutOfBlocksError(f"request {request_id!r} needs {need} new blocks, {self.free_queue.num_free} free")
        new = self._pop_many(max(0, need))
        req.blocks.extend(new)
        return [b.block_id for b in new]

    def commit(self, request_id: str, num_tokens: int | None = None) -> list[tuple[int, bytes]]:
        """The KV of the request's first ``num_tokens`` tokens (all when None) is written.

        Registers the full blocks among them, so later requests hit them, and
        returns ``(block_id, block_hash)`` of each block computed since the last
        commit, in prefix order (blocks served from the pool or loaded from a
        lower tier were not computed and are never reported).
        """
        req = self._request(request_id)
        n = req.num_tokens if num_tokens is None else min(num_tokens, req.num_tokens)
        full = min(n // self.block_size, len(req.hashes), len(req.blocks))
        if full <= req.committed:
            return []
        cached = self.cached
        out = []
        for b, h in zip(req.blocks[req.committed:full], req.hashes[req.committed:full]):
            if b.block_hash is None and h not in cached:  # _register, inlined: the hot path
                cached[h] = b
                b.block_hash = h
            out.append((b.block_id, h))
        req.committed = full
        return out

    def invalidate(self, request_id: str, position: int) -> None:
        """The request's blocks from ``position`` on do not hold their KV (a failed load):
        unregister their hashes so nobody hits them; they stay in the block table."""
        req = self._request(request_id)
        for b in req.blocks[position:]:
            self.evict_cached(b)
        req.committed = min(req.committed, position)

    def append(self, request_id: str, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Append tokens to a request; return copy-on-write ops ``(src, dst)`` to perform.

        A partial, shared last block is copied on write before new tokens land in
        it. Blocks that become full are hashed (continuing the chain); they are
        registered by :meth:`commit`. Raises :class:`OutOfBlocksError`, or
        ``ValueError`` for a token that is not an integer in ``[0, 2**32)``, with
        nothing changed.
        """
        req = self._request(request_id)
        if req.tokens is None:
            raise ValueError(f"request_id: {request_id!r} was allocated from block hashes; it has no tokens to extend")
        new = list(token_ids)
        if not new:
            return []
        self.hasher.check_tokens(new)  # before anything changes
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
        self.hasher.extend(req.hashes, req.tokens, cache_salt=req.cache_salt, lora_id=req.lora_id)
        return ops

    def fork(self, parent_request_id: str, child_request_id: str) -> None:
        """Share the parent's blocks with a new child request (n > 1 sampling)."""
        parent = self._request(parent_request_id)
        if child_request_id in self.requests:
            raise ValueError(f"child_request_id: {child_request_id!r} is already allocated")
        for b in parent.blocks:
            b.ref_cnt += 1
        tokens = list(parent.tokens) if parent.tokens is not None else None
        child = _Request(Prompt(list(parent.hashes), parent.num_tokens, 0, tokens, parent.cache_salt,
                                parent.lora_id), list(parent.blocks))
        child.committed = parent.committed
        self.requests[child_request_id] = child

    def free(self, request_id: str) -> None:
        """Release a request. Blocks reaching ref_cnt 0 keep content and hash: hashed
        ones join the free queue's tail, last block first (so the prompt's first block
        is the last of them to be evicted); blocks without a hash go to its head."""
        req = self.requests.pop(request_id, None)
        if req is None:
            raise ValueError(f"request_id: {request_id!r} is not allocated")
        first: list[Block] = []
        last: list[Block] = []
        for b in reversed(req.blocks):
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"{b}: ref_cnt below zero"
            if b.ref_cnt == 0:
                (first if b.block_hash is None else last).append(b)
        self.free_queue.extend(last)
        for b in reversed(first):
            self.free_queue.appendleft(b)

    def take_evicted(self) -> list[tuple[int, bytes]]:
        """``(block_id, block_hash)`` of the hashed blocks popped for reuse since the last
        call, in order (empty unless ``track_evictions``)."""
        out = self._evicted
        if out:
            self._evicted = []
            return out
        return []

    def evict_cached(self, block: Block) -> None:
        """Drop a block's hash (its bytes become garbage)."""
        h = block.block_hash
        if h is None:
            return
        block.block_hash = None
        if self.cached.get(h) is block:
            del self.cached[h]

    def free_window(self, n: int) -> list[tuple[int, bytes]]:
        """``(block_id, hash)`` of the hashed blocks among the ``n`` next to be evicted."""
        return self.free_queue.hashed_head(n)

    def resident(self) -> list[tuple[int, bytes]]:
        """``(block_id, hash)`` of every hashed block, most recently used first: blocks in
        use by a request, then free ones from the most recently freed."""
        in_use = [(b.block_id, h) for h, b in self.cached.items() if b.ref_cnt > 0]
        free = [(b.block_id, b.block_hash) for b in self.free_queue.reversed() if b.block_hash is not None]
        return in_use + free  # type: ignore[return-value]

    # --------------------------------------------------------------- internals

    def _request(self, request_id: str) -> _Request:
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"request_id: {request_id!r} is not allocated")
        return req

    def _pop(self) -> Block:
        return self._pop_many(1)[0]

    def _pop_many(self, n: int) -> list[Block]:
        """Take ``n`` blocks from the head of the free queue (the caller checked there are
        enough), evicting their hashes in order: ``on_evict`` sees each before it is reused."""
        queue = self.free_queue
        if n > queue.num_free:
            raise OutOfBlocksError(f"{n} blocks needed, {queue.num_free} free")
        head = queue._head
        cached, on_evict, evicted = self.cached, self.on_evict, self._evicted
        out: list[Block] = []
        block = head.next_free
        for _ in range(n):
            assert block is not None
            out.append(block)
            h = block.block_hash
            if h is not None:
                block.block_hash = None
                if cached.get(h) is block:
                    del cached[h]
                if evicted is not None:
                    evicted.append((block.block_id, h))
                if on_evict is not None:
                    on_evict(block.block_id, h)
            block.ref_cnt = 1
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        head.next_free = block
        block.prev_free = head  # type: ignore[union-attr]
        queue.num_free -= len(out)
        return out

    def _register(self, block: Block, block_hash: bytes) -> None:
        if block.block_hash is None and block_hash not in self.cached:
            self.cached[block_hash] = block
            block.block_hash = block_hash
