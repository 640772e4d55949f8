"""BlockManager semantics: exact eviction order, the seed's worked examples, isolation."""
from __future__ import annotations

import pytest

from tierkv import BlockHasher, BlockManager, OutOfBlocksError
from tierkv.block_pool import Block, FreeBlockQueue


def free_ids(m: BlockManager) -> list[int]:
    return [b.block_id for b in m.free_queue]


def test_free_queue_o1_ops_and_order():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    assert [b.block_id for b in q] == [1, 3, 4, 0] and len(q) == 4
    for _ in range(4):
        q.popleft()
    with pytest.raises(OutOfBlocksError):
        q.popleft()
    assert q.peek() is None


def test_initial_queue_and_allocation_from_head():
    m = BlockManager(6, 4)
    assert free_ids(m) == list(range(6))
    a = m.allocate("r", list(range(9)))  # 3 blocks, 2 full
    assert a.block_ids == [0, 1, 2] and a.num_cached_tokens == 0
    assert m.num_cached_blocks == 2 and m.num_free_blocks == 3


def test_seed_r1_r2_share_system_prompt_blocks():
    """Seed 6.1: R1 and R2 share blocks 0-1 (system prompt), diverge in block 2."""
    m = BlockManager(10, 4)
    system = list(range(100, 108))  # two full blocks
    r1 = m.allocate("R1", system + [1, 2, 3, 4])
    r2 = m.allocate("R2", system + [5, 6, 7, 8])
    assert r2.block_ids[:2] == r1.block_ids[:2]
    assert r2.block_ids[2] != r1.block_ids[2]
    assert r2.num_cached_tokens == 8
    assert [m.blocks[i].ref_cnt for i in r1.block_ids] == [2, 2, 1]


def test_last_prompt_token_is_always_computed():
    m = BlockManager(10, 4)
    toks = list(range(8))  # exactly two full blocks
    m.allocate("a", toks)
    m.free("a")
    b = m.allocate("b", toks)
    assert b.num_cached_tokens == 4  # only (8-1)//4 = 1 block may hit
    # the second full block stays registered to the earlier block: b's copy is unregistered
    assert m.blocks[b.block_ids[1]].block_hash is None


def test_timestamp_first_prompt_never_hits():
    """Seed 6.3: a varying timestamp in front breaks every later block."""
    m = BlockManager(64, 4)
    rules = list(range(1000, 1040))
    for second in range(5):
        a = m.allocate(f"q{second}", [second, 0, 0, 0] + rules + [7])
        assert a.num_cached_tokens == 0
        m.free(f"q{second}")
    good = [m.allocate(f"g{s}", rules + [s, 7]) for s in range(3)]
    assert [g.num_cached_tokens for g in good] == [0, 40, 40]


def test_free_reverse_order_and_exact_eviction_order():
    evicted: list[int] = []
    m = BlockManager(6, 2, on_evict=lambda bid, h: evicted.append(bid))
    m.allocate("a", [1, 2, 3, 4, 5, 6])  # blocks 0,1,2 all full and hashed
    m.allocate("b", [9, 9, 8])  # blocks 3,4
    m.free("a")
    # freed last to first: tail gets 2, 1, 0
    assert free_ids(m) == [5, 2, 1, 0]
    m.free("b")
    assert free_ids(m) == [5, 2, 1, 0, 4, 3]
    m.allocate("c", [7, 7, 7, 7, 7, 7, 7])  # 4 new blocks: 5 (unhashed), then 2, 1, 0 evicted in that order
    assert evicted == [2, 1, 0]
    assert m.num_cached_blocks == 3 + 1  # b's full block + c's three full blocks
    assert free_ids(m) == [4, 3]


def test_hit_removes_block_from_middle_of_free_queue():
    m = BlockManager(6, 2)
    m.allocate("a", [1, 2, 3, 4, 5])
    m.free("a")
    assert free_ids(m) == [3, 4, 5, 2, 1, 0]
    b = m.allocate("b", [1, 2, 3, 4, 6])
    assert b.block_ids[:2] == [0, 1] and b.num_cached_tokens == 4
    assert free_ids(m) == [4, 5, 2]  # 0 and 1 removed; 3 popped for the new block
    assert m.blocks[2].block_hash is None  # a's partial block was never hashed


def test_out_of_blocks_changes_nothing():
    m = BlockManager(4, 2)
    m.allocate("a", [1, 2, 3, 4])
    m.free("a")
    before = (free_ids(m), dict(m.cached), {b.block_id: b.ref_cnt for b in m.blocks})
    with pytest.raises(OutOfBlocksError):
        m.allocate("b", [1, 2, 3, 4] + list(range(10, 17)))  # needs 5 blocks with hit on block 0
    assert (free_ids(m), dict(m.cached), {b.block_id: b.ref_cnt for b in m.blocks}) == before
    assert "b" not in m.requests
    m.allocate("c", [5, 6, 7])
    with pytest.raises(OutOfBlocksError):
        m.append("c", list(range(20)))
    assert m.num_tokens("c") == 3


def test_seed_n4_fork_and_cow():
    """Seed 5: a 40-token prompt (3 blocks of 16, last half full), n=4 fork, COW of b12."""
    m = BlockManager(32, 16)
    prompt = list(range(40))
    a = m.allocate("seq0", prompt)
    for i in (1, 2, 3):
        m.fork("seq0", f"seq{i}")
    assert [m.blocks[b].ref_cnt for b in a.block_ids] == [4, 4, 4]
    last = a.block_ids[2]
    ops = m.append("seq0", [500])
    assert len(ops) == 1 and ops[0][0] == last
    new = ops[0][1]
    assert m.block_ids("seq0") == a.block_ids[:2] + [new]
    assert m.blocks[last].ref_cnt == 3 and m.blocks[new].ref_cnt == 1
    assert m.append("seq0", [501]) == []  # now private: no more copies
    for i in (1, 2):
        assert len(m.append(f"seq{i}", [600 + i])) == 1
    assert m.append("seq3", [603]) == []  # the last sharer writes in place
    assert m.blocks[last].ref_cnt == 1 and m.block_ids("seq3")[2] == last


def test_append_hashes_and_registers_full_blocks():
    m = BlockManager(8, 4)
    m.allocate("a", [1, 2, 3])
    m.append("a", [4, 5])  # block 0 becomes full
    h = BlockHasher(4).hash_blocks([1, 2, 3, 4])
    assert m.block_hashes("a") == h and m.cached[h[0]].block_id == m.block_ids("a")[0]
    m.free("a")
    b = m.allocate("b", [1, 2, 3, 4, 9])
    assert b.num_cached_tokens == 4


def test_full_shared_last_block_needs_no_cow():
    m = BlockManager(8, 2)
    m.allocate("a", [1, 2, 3, 4])
    m.fork("a", "b")
    assert m.append("a", [5]) == []
    assert m.block_ids("a")[:2] == m.block_ids("b")


def test_cache_salt_isolation():
    m = BlockManager(32, 4)
    toks = list(range(40))
    a = m.allocate("a", toks, cache_salt="tenant-a")
    b = m.allocate("b", toks, cache_salt="tenant-b")
    assert b.num_cached_tokens == 0 and not set(a.block_ids) & set(b.block_ids)
    c = m.allocate("c", toks, cache_salt="tenant-a")
    assert c.num_cached_tokens == 36


def test_lora_isolation():
    m = BlockManager(32, 4)
    toks = list(range(40))
    a = m.allocate("a", toks, lora_id="sql-adapter")
    b = m.allocate("b", toks, lora_id="chat-adapter")
    n = m.allocate("n", toks)
    assert b.num_cached_tokens == 0 and n.num_cached_tokens == 0
    assert not set(a.block_ids) & set(b.block_ids) & set(n.block_ids)


def test_block_hashes_instead_of_tokens():
    m = BlockManager(8, 4)
    hs = [b"h0", b"h1", b"h2"]
    m.allocate("a", block_hashes=hs)
    m.free("a")
    b = m.allocate("b", block_hashes=hs)  # no token count: every named block may hit
    assert b.num_cached_tokens == 12 and b.block_ids == [0, 1, 2]
    m.free("b")
    capped = m.allocate("capped", block_hashes=hs, num_tokens=12)  # 12 tokens: cap (12-1)//4 = 2
    assert capped.num_cached_tokens == 8
    m.free("capped")
    c = m.allocate("c", block_hashes=hs[:2], num_tokens=10)
    assert c.num_cached_tokens == 8 and len(c.block_ids) == 3
    with pytest.raises(ValueError, match="block_hashes"):
        m.allocate("d", block_hashes=[b"x", b"x"])


def test_external_hits_extend_the_walk_and_get_new_blocks():
    m = BlockManager(8, 2)
    m.allocate("a", [1, 2, 3, 4, 5])
    m.free("a")
    lower = set(BlockHasher(2).hash_blocks([1, 2, 3, 4, 5, 6, 7, 8])[2:3])
    a = m.allocate("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], external_hit=lambda pos, h: h in lower)
    assert a.num_gpu_hit_blocks == 2 and a.num_cached_tokens == 6
    assert [pos for pos, _, _ in a.external] == [2]
    assert m.cached[a.external[0][2]].block_id == a.external[0][1]


def test_bad_arguments():
    m = BlockManager(4, 2)
    with pytest.raises(ValueError, match="token_ids"):
        m.allocate("a", [])
    m.allocate("a", [1])
    with pytest.raises(ValueError, match="request_id"):
        m.allocate("a", [1])
    with pytest.raises(ValueError, match="request_id"):
        m.free("zzz")
    with pytest.raises(ValueError, match="child_request_id"):
        m.fork("a", "a")
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 2)
