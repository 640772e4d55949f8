"""A paged block pool shared by several KV-cache groups: vLLM's hybrid allocator, modelled.

A hybrid model's groups (:mod:`kvstrata.identity.groups`) each keep a block table
of their own over one pool of rows and one LRU free queue, as vLLM's
``HybridKVCacheCoordinator`` over its ``BlockPool``. The replay drives it as
it drives :class:`~kvstrata.pool.blocks.BlockManager`, and it frees, evicts and
hands out blocks in vLLM's order:

* a prefix hit of ``n`` blocks needs, in every group, what
  :meth:`KVGroups.hit_end` says (the longest such ``n`` is vLLM's fixed point);
* a group's blocks that a hit skips (before a window) are padded with the null
  block (row 0) and stay where they are in the free queue;
* a sliding-window group caches (hashes) only the blocks a later hit can use:
  the window before the prompt's last hit point, and before the shared-prefix
  junction (the full-attention hit, when it ran past the reconciled one).
  This is vLLM's sparse retention (``prefix_cache_retention_interval: 0``,
  its default; ``reachable_block_mask``). Its other blocks are computed, never
  hit on the device, and reused first; which computed blocks the tiers below
  keep is the driver core's rule (``stored``, :meth:`allocate`);
* allocation touches every group's hit blocks first, then takes new blocks
  group by group, each from the free queue's head (evicting what it held);
* a request's blocks are freed group by group, each group's last block first;
  blocks without a hash go to the head of the free queue, hashed ones to its tail;
* once a request decodes past its prompt, and when it finishes (before the rest,
  as vLLM does before it hands the block table to a KV connector), a window
  group frees the blocks its window left behind (:meth:`release_skipped`);
* a state group (vLLM's ``align`` mode, ``MambaManager``) holds one row per
  state, at the position whose state it is, null rows between: a step that
  takes the request into a new block takes one row, at that block, for the
  running state; the step after it frees the state before (what precedes the
  last computed token is skipped), and the request's hit state once it moved
  on. The engine caches a state only where a later hit can end
  (:meth:`KVGroups.state_cached`), and computes one there only because its
  prefill chunks end there (:meth:`KVGroups.chunk_end`).

As in vLLM, a key may name several rows (a block loaded from below while the
device still held it under the same key, which a window's hit could not use):
a hit takes the earliest cached of them, each is evicted on its own.

Keys are per group: ``key(g, i)`` gives group ``g``'s key for position ``i``
of a request (:meth:`~kvstrata.core.request.RequestState.group_key`).
Rows are ``1 .. num_blocks``; row 0 is the null block and never cached.

A prefill runs in the chunks vLLM's scheduler gives a request alone in its
steps (:meth:`KVGroups.chunk_end`): ``max_num_batched_tokens`` tokens each
(``budget``; None: the whole prompt at once), block-aligned and stopping where
a state is cached when there are state groups; each chunk a step
(:meth:`advance`).
"""

from __future__ import annotations

from typing import Callable, Sequence

from kvstrata.pool.blocks import Allocation, Prompt
from kvstrata.identity.groups import FULL, SLIDING, STATE, KVGroups
from kvstrata.errors import OutOfBlocksError
from kvstrata.pool.free_queue import Block, FreeBlockQueue

__all__ = ["GroupedBlockManager", "Key"]

Key = Callable[[int, int], bytes]  # (group, position) -> the group's key of that block
Stored = Callable[[int, int], bool]  # (group, position) -> do the tiers below keep that block


class _Request:
    __slots__ = ("prompt", "key", "tables", "committed", "ends", "computed", "stored", "prefill", "junction",
                 "retired")

    def __init__(self, prompt: Prompt, key: Key, tables: list[list[Block]], committed: int,
                 ends: tuple[int, ...], computed: int, stored: Stored | None, prefill: int, junction: int) -> None:
        self.prompt, self.key, self.tables, self.committed = prompt, key, tables, committed
        self.stored = stored  # which computed blocks are offered to the tiers below (None: all)
        self.ends = ends  # positions a later hit of this prompt can end at (sliding groups keep their windows)
        self.computed = computed  # tokens computed once the current step ran; decode steps take it to num_tokens
        self.prefill = prefill  # tokens the prefill computes (the prompt's)
        self.junction = junction  # tokens of the shared-prefix junction (0: none), where a chunk ends
        self.retired = [0] * len(tables)  # per group: positions below this are freed (or null)


class GroupedBlockManager:
    """``num_blocks`` rows shared by the groups of ``groups`` (see the module docstring)."""

    def __init__(self, num_blocks: int, groups: KVGroups, *, track_evictions: bool = False,
                 budget: int | None = None) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks: expected a positive integer, got {num_blocks!r}")
        self.groups = groups
        self.block_size = groups.block_size
        self.budget = budget  # the engine's token budget per step (max_num_batched_tokens), None: unlimited
        # per group: blocks of the window before a hit point (sliding), 0 when every block is kept
        self._window = [-(-(g.tokens - 1) // self.block_size) if g.kind == SLIDING else 0 for g in groups.groups]
        self._full = [g for g, group in enumerate(groups.groups) if group.kind == FULL]
        self._state = [group.kind == STATE for group in groups.groups]
        self.blocks = [Block(i) for i in range(num_blocks + 1)]
        self.null = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[bytes, dict[int, Block]] = {}  # key -> its rows, earliest cached first
        self.requests: dict[str, _Request] = {}
        self._evicted: list[tuple[int, bytes]] | None = [] if track_evictions else None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_cached_blocks(self) -> int:
        return sum(map(len, self.cached.values()))

    def block_ids(self, request_id: str) -> list[list[int]]:
        return [[b.block_id for b in table] for table in self._request(request_id).tables]

    def lookup(self, prompt: Prompt, key: Key) -> int:
        """How many leading blocks of ``prompt`` every group holds what it needs for. Pure."""
        cached = self.cached
        return self.groups.hit_end(0, prompt.cap, lambda g, i: key(g, i) in cached)

    def blocks_needed(self, prompt: Prompt) -> int:
        """Rows the prompt takes without a hit: every attention group holds its whole prompt
        until the prefill is done, a state group two states at most (the last and the running)."""
        n = -(-prompt.num_tokens // self.block_size)
        return sum(min(2, n) if state else n for state in self._state)

    # ---------------------------------------------------------------- requests

    def allocate(self, request_id: str, *, prompt: Prompt, key: Key, num_external: int = 0,
                 num_blocks: int | None = None, prefill: int | None = None, stored: Stored | None = None
                 ) -> Allocation:
        """The request's block tables: the pool's hit (:meth:`lookup`), then ``num_external``
        blocks from a lower tier (registered under their keys, to be loaded), then new blocks up
        to ``num_blocks`` positions (when None: the prefill's first chunk, computed now; the
        rest by :meth:`advance`). A group's blocks that the prefix ``hit + num_external`` skips
        are null. ``prefill``: the tokens the prefill
        computes (the prompt's; by default all of ``prompt``), the rest by :meth:`decode`.
        ``stored``: which of its computed blocks :meth:`commit` offers to the tiers below (the
        driver core's :meth:`~kvstrata.core.driver.DriverCore.stored`; all by default).
        Raises :class:`OutOfBlocksError` with nothing changed."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already allocated")
        hit = self.lookup(prompt, key)
        prefix = min(hit + max(0, num_external), prompt.cap)
        prefill = prompt.num_tokens if prefill is None else min(prefill, prompt.num_tokens)
        junction = self._full_hit(prompt, key)
        last = min(max(prefill - 1, 0) // self.block_size, len(prompt.hashes))  # the prompt's last hit point
        ends = (last, junction) if junction > hit else (last,)
        junction = junction * self.block_size if junction > hit else 0
        computed = self.groups.chunk_end(prefix * self.block_size, prefill, junction, self.budget)
        if num_blocks is None:  # the first chunk is computed now
            total = -(-computed // self.block_size)
        else:  # loaded first: the rest is computed by grow and advance
            total, computed = max(num_blocks, prefix), prefix * self.block_size
        skips = [min(self.groups.needed_from(g, prefix), prefix) for g in range(len(self.groups))]
        touched = [[next(iter(self.cached[key(g, i)].values())) for i in range(skip, hit)]
                   for g, skip in enumerate(skips)]
        new = sum(prefix - max(skip, hit) + self._need(g, prefix, total) for g, skip in enumerate(skips))
        reusable = sum(1 for table in touched for b in table if b.ref_cnt == 0)
        if new > self.free_queue.num_free - reusable:
            raise OutOfBlocksError(f"request {request_id!r} needs {new} new blocks, "
                                   f"{self.free_queue.num_free - reusable} free")
        for table in touched:
            for b in table:
                if b.ref_cnt == 0:
                    self.free_queue.remove(b)
                b.ref_cnt += 1
        tables = [[self.null] * skip + hits for skip, hits in zip(skips, touched)]
        external: list[tuple[int, int, bytes]] = []
        for g, table in enumerate(tables):  # vLLM: every group's hits are touched before any row is taken
            start = len(table)
            table.extend(self._pop_many(prefix - start))
            for i in range(start, prefix):
                external.append((i, table[i].block_id, key(g, i)))
                if self._kept(g, i, ends):
                    self._register(table[i], key(g, i))
        for g, table in enumerate(tables):
            self._fill(g, table, total)
        self.requests[request_id] = _Request(prompt, key, tables, prefix, ends, computed, stored, prefill, junction)
        ids = [[b.block_id for b in t] for t in tables]
        return Allocation(ids, prefix * self.block_size, hit, external, ids)

    def grow(self, request_id: str) -> list[int]:
        """After a load: every group's blocks for the prefill's first chunk computed; returns the
        new rows."""
        req = self._request(request_id)
        return self._step(request_id, self._chunk_end(req, req.committed * self.block_size))

    def advance(self, request_id: str) -> bool:
        """The prefill's next chunk (:meth:`KVGroups.chunk_end`), as a step of its own: False
        when the prefill is done. Raises :class:`OutOfBlocksError` with only what the states
        left behind freed."""
        req = self._request(request_id)
        if req.computed >= req.prefill:
            return False
        self._step(request_id, self._chunk_end(req, req.computed))
        return True

    def _chunk_end(self, req: _Request, start: int) -> int:
        """Where the request's prefill chunk from token ``start`` ends (:meth:`KVGroups.chunk_end`)."""
        return self.groups.chunk_end(start, req.prefill, req.junction, self.budget)

    def _step(self, request_id: str, end: int) -> list[int]:
        """A step computing the request's tokens up to ``end``: vLLM's ``allocate_slots`` frees
        what the tokens computed before skip, then gives every group its rows for ``end``."""
        req = self._request(request_id)
        self.release_skipped(request_id, req.computed)
        n = -(-end // self.block_size)
        need = sum(self._need(g, len(t), n) for g, t in enumerate(req.tables))
        if need > self.free_queue.num_free:
            raise OutOfBlocksError(f"request {request_id!r} needs {need} new blocks, {self.free_queue.num_free} free")
        out = []
        for g, table in enumerate(req.tables):
            out.extend(b.block_id for b in self._fill(g, table, n))
        req.computed = end
        return out

    def commit(self, request_id: str, num_tokens: int | None = None) -> list[tuple[int, bytes]]:
        """The prompt's KV is written (what the steps computed; at most ``num_tokens`` of it):
        registers its full blocks, group by group, and returns ``(row, key)`` of each one
        computed since the last commit that the tiers below keep (not the null ones)."""
        req = self._request(request_id)
        done = req.computed if num_tokens is None else min(num_tokens, req.computed)
        full = min(done // self.block_size, len(req.prompt.hashes))
        lo = req.committed
        if full <= lo:
            return []
        out = []
        stored = req.stored
        for g, table in enumerate(req.tables):
            state = self._state[g]
            for i in range(lo, min(full, len(table))):
                b = table[i]
                if b is not self.null:
                    k = req.key(g, i)
                    kept = self._kept(g, i, req.ends)
                    if kept:
                        self._register(b, k)
                    if kept if state else stored is None or stored(g, i):  # a state is stored once cached
                        out.append((b.block_id, k))
        req.committed = full
        return out

    def invalidate(self, request_id: str, position: int) -> None:
        """The request's blocks from ``position`` on hold no KV (a failed load): unregistered."""
        req = self._request(request_id)
        for table in req.tables:
            for b in table[position:]:
                self.evict_cached(b)
        req.committed = min(req.committed, position)

    def decode_steps(self, request_id: str) -> list[int]:
        """The decode steps after the prefill at which the pool changes (the first, as the
        windows move past the prompt; a window leaves a block behind, a block is needed or
        becomes full): the tokens computed before each. Those of the prompt's tokens after
        its prefill (a recorded output), else the first output token's."""
        req = self._request(request_id)
        bs, start, end = self.block_size, req.computed, req.prompt.num_tokens
        groups = self.groups.groups
        return [t for t in range(start, end) if t % bs == 0 or (t + 1) % bs == 0 or t == start
                or any(g.skipped_tokens(t) // bs != g.skipped_tokens(t - 1) // bs for g in groups)] or [start]

    def decode(self, request_id: str, t: int) -> list[tuple[int, bytes]]:
        """The decode step computing token ``t`` (``t`` computed before it): vLLM's
        ``allocate_slots`` frees what the windows left behind, gives every group the block
        for ``t``, and caches the blocks that are full with it. Returns those, as :meth:`commit`.
        Raises :class:`OutOfBlocksError` with only the windows' blocks freed."""
        req = self._request(request_id)
        req.computed = t
        self._step(request_id, t + 1)
        return self.commit(request_id)

    def release_skipped(self, request_id: str, num_tokens: int) -> None:
        """``num_tokens`` of the request are computed and it goes on decoding: each group frees
        the blocks before what its next token attends (vLLM's ``remove_skipped_blocks``)."""
        req = self._request(request_id)
        for g, table in enumerate(req.tables):
            skip = min(self.groups.groups[g].skipped_tokens(num_tokens) // self.block_size, len(table))
            state = self._state[g]
            freed = []
            for i in range(skip - 1, req.retired[g] - 1, -1):
                if table[i] is self.null:
                    if state:  # a state group's rows have null gaps between states
                        continue
                    break
                freed.append(table[i])
                table[i] = self.null
            req.retired[g] = max(req.retired[g], skip)
            self._release(freed)

    def free(self, request_id: str) -> None:
        """Release a request: the blocks its windows left behind, then group by group, each
        group's last block first."""
        req = self._request(request_id)
        self.release_skipped(request_id, req.computed)
        del self.requests[request_id]
        for table in req.tables:
            self._release([b for b in reversed(table) if b is not self.null])

    def append(self, request_id: str, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        raise ValueError(f"append: request {request_id!r}: a pool of KV-cache groups holds a request's "
                         "prompt; its decode blocks are the engine's (allocate the longer prompt instead)")

    def fork(self, parent_request_id: str, child_request_id: str) -> None:
        raise ValueError(f"fork: request {parent_request_id!r}: a pool of KV-cache groups does not share "
                         "block tables between requests (allocate the child's prompt: its prefix is a hit)")

    def resident(self) -> list[tuple[int, bytes]]:
        """``(row, key)`` of every cached row, most recently used first: rows in use by a
        request, then free ones from the most recently freed."""
        in_use = [(b.block_id, h) for h, rows in self.cached.items() for b in rows.values() if b.ref_cnt > 0]
        free = [(b.block_id, b.block_hash) for b in self.free_queue.reversed() if b.block_hash is not None]
        return in_use + free  # type: ignore[return-value]

    def take_evicted(self) -> list[tuple[int, bytes]]:
        """``(row, key)`` of the hashed blocks handed out again since the last call, in order."""
        out = self._evicted
        if out:
            self._evicted = []
            return out
        return []

    def evict_cached(self, block: Block) -> None:
        h = block.block_hash
        if h is None or block is self.null:
            return
        block.block_hash = None
        rows = self.cached.get(h)
        if rows is not None and rows.pop(block.block_id, None) is not None and not rows:
            del self.cached[h]

    def free_window(self, n: int) -> list[tuple[int, bytes]]:
        """``(row, key)`` of the hashed blocks among the ``n`` next to be evicted."""
        return self.free_queue.hashed_head(n)

    def _request(self, request_id: str) -> _Request:
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"request_id: {request_id!r} is not allocated")
        return req

    def _full_hit(self, prompt: Prompt, key: Key) -> int:
        """The prefix every full-attention group holds (the hit before the windows cut it)."""
        n = 0
        cached = self.cached
        while n < prompt.cap and all(key(g, n) in cached for g in self._full):
            n += 1
        return n if self._full else 0

    def _kept(self, g: int, i: int, ends: tuple[int, ...]) -> bool:
        """Does group ``g`` cache its block ``i`` (a window before one of ``ends``, a state
        where a hit can end)?"""
        if self._state[g]:
            return self.groups.state_cached(i, ends)
        w = self._window[g]
        return not w or any(end - w <= i < end for end in ends)

    def _need(self, g: int, length: int, n: int) -> int:
        """New rows group ``g`` takes to cover ``n`` positions, holding ``length``."""
        if n <= length:
            return 0
        return 1 if self._state[g] else n - length

    def _fill(self, g: int, table: list[Block], n: int) -> list[Block]:
        """Group ``g``'s rows up to ``n`` positions: every position of an attention group; of a
        state group, one row for the running state at the last, null rows before it."""
        if n <= len(table):
            return []
        if self._state[g]:
            table.extend([self.null] * (n - 1 - len(table)))
        new = self._pop_many(self._need(g, len(table), n))
        table.extend(new)
        return new

    def _release(self, ordered: Sequence[Block]) -> None:
        """vLLM's ``free_blocks``: unhashed rows to the head (first of them first), hashed
        ones to the tail, in ``ordered``'s order."""
        first: list[Block] = []
        last: list[Block] = []
        for b in ordered:
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"{b}: ref_cnt below zero"
            if b.ref_cnt == 0:
                (first if b.block_hash is None else last).append(b)
        for b in reversed(first):
            self.free_queue.appendleft(b)
        self.free_queue.extend(last)

    def _pop_many(self, n: int) -> list[Block]:
        if n <= 0:
            return []
        if n > self.free_queue.num_free:
            raise OutOfBlocksError(f"{n} blocks needed, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            h = b.block_hash
            if h is not None:
                self.evict_cached(b)
                if self._evicted is not None:
                    self._evicted.append((b.block_id, h))
            b.ref_cnt = 1
            out.append(b)
        return out

    def _register(self, block: Block, key: bytes) -> None:
        if block.block_hash is None:
            self.cached.setdefault(key, {})[block.block_id] = block
            block.block_hash = key
