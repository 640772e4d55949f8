"""BlockManager semantics: exact eviction order, the seed's worked examples, isolation."""
from __future__ import annotations

import pytest

from kvstrata import BlockHasher, BlockManager, OutOfBlocksError
from kvstrata.pool.blocks import Block, FreeBlockQueue


def free_ids(m: BlockManager) -> list[int]:
    return [b.block_id for b in m.free_queue]


def run(m: BlockManager, rid: str, tokens: list[int] | None = None, **kw):
    """Allocate and compute a request (its KV written: commit)."""
    a = m.allocate(rid, tokens, **kw)
    m.commit(rid)
    return a


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
    a = run(m, "r", list(range(9)))  # 3 blocks, 2 full
    assert a.block_ids == [0, 1, 2] and a.num_cached_tokens == 0
    assert m.num_cached_blocks == 2 and m.num_free_blocks == 3


def test_seed_r1_r2_share_system_prompt_blocks():
    """Seed 6.1: R1 and R2 share blocks 0-1 (system prompt), diverge in block 2."""
    m = BlockManager(10, 4)
    system = list(range(100, 108))  # two full blocks
    r1 = run(m, "R1", system + [1, 2, 3, 4])
    r2 = run(m, "R2", system + [5, 6, 7, 8])
    assert r2.block_ids[:2] == r1.block_ids[:2]
    assert r2.block_ids[2] != r1.block_ids[2]
    assert r2.num_cached_tokens == 8
    assert [m.blocks[i].ref_cnt for i in r1.block_ids] == [2, 2, 1]


def test_last_prompt_token_is_always_computed():
    m = BlockManager(10, 4)
    toks = list(range(8))  # exactly two full blocks
    run(m, "a", toks)
    m.free("a")
    b = run(m, "b", toks)
    assert b.num_cached_tokens == 4  # only (8-1)//4 = 1 block may hit
    # the second full block stays registered to the earlier block: b's copy is unregistered
    assert m.blocks[b.block_ids[1]].block_hash is None


def test_timestamp_first_prompt_never_hits():
    """Seed 6.3: a varying timestamp in front breaks every later block."""
    m = BlockManager(64, 4)
    rules = list(range(1000, 1040))
    for second in range(5):
        a = run(m, f"q{second}", [second, 0, 0, 0] + rules + [7])
        assert a.num_cached_tokens == 0
        m.free(f"q{second}")
    good = [run(m, f"g{s}", rules + [s, 7]) for s in range(3)]
    assert [g.num_cached_tokens for g in good] == [0, 40, 40]


def test_free_reverse_order_and_exact_eviction_order():
    evicted: list[int] = []
    m = BlockManager(6, 2, on_evict=lambda bid, h: evicted.append(bid))
    run(m, "a", [1, 2, 3, 4, 5, 6])  # blocks 0,1,2 all full and hashed
    run(m, "b", [9, 9, 8])  # blocks 3 (hashed), 4 (partial: no hash)
    m.free("a")
    # freed last to first: tail gets 2, 1, 0
    assert free_ids(m) == [5, 2, 1, 0]
    m.free("b")
    # b's partial block goes to the head (reused first, as in vLLM); its full block to the tail
    assert free_ids(m) == [4, 5, 2, 1, 0, 3]
    run(m, "c", [7, 7, 7, 7, 7, 7, 7])  # 4 new blocks: 4, 5 (unhashed), then 2, 1 evicted in that order
    assert evicted == [2, 1]
    assert m.num_cached_blocks == 2 + 3  # a's block 0, b's full block, c's three full blocks
    assert free_ids(m) == [0, 3]


def test_hit_removes_block_from_middle_of_free_queue():
    m = BlockManager(6, 2)
    run(m, "a", [1, 2, 3, 4, 5])
    m.free("a")
    assert free_ids(m) == [2, 3, 4, 5, 1, 0]  # the partial block 2 at the head, 1 and 0 at the tail
    b = run(m, "b", [1, 2, 3, 4, 6])
    assert b.block_ids[:2] == [0, 1] and b.num_cached_tokens == 4
    assert free_ids(m) == [3, 4, 5]  # 0 and 1 removed from the middle; 2 popped for the new block
    assert m.blocks[2].block_hash is None  # a's partial block was never hashed


def test_uncommitted_blocks_are_never_hits_and_go_first():
    """An aborted request (freed before its KV was written) caches nothing."""
    m = BlockManager(6, 2)
    a = m.allocate("a", [1, 2, 3, 4, 5])
    assert m.num_cached_blocks == 0
    m.free("a")
    assert free_ids(m)[:3] == a.block_ids[::-1]  # reused first, last block first (vLLM's order)
    b = run(m, "b", [1, 2, 3, 4, 5])
    assert b.num_cached_tokens == 0
    m.free("b")
    assert run(m, "c", [1, 2, 3, 4, 9]).num_cached_tokens == 4


def test_commit_registers_computed_prefix_and_reports_each_block_once():
    m = BlockManager(8, 2)
    a = m.allocate("a", [1, 2, 3, 4, 5, 6, 7])
    assert m.commit("a", 3) == [(a.block_ids[0], m.block_hashes("a")[0])]
    assert m.num_cached_blocks == 1
    rest = m.commit("a")
    assert [b for b, _ in rest] == a.block_ids[1:3] and m.commit("a") == []
    m.append("a", [8])  # block 3 becomes full; registered only when committed
    assert m.num_cached_blocks == 3
    assert m.commit("a") == [(a.block_ids[3], m.block_hashes("a")[3])] and m.num_cached_blocks == 4


def test_lookup_is_pure_and_prompt_caps_the_last_token():
    m = BlockManager(8, 2)
    run(m, "a", [1, 2, 3, 4, 5])
    m.free("a")
    before = free_ids(m)
    p = m.prompt([1, 2, 3, 4])
    assert p.cap == 1 and m.lookup(p) == 1  # (4 - 1) // 2: the last token is always computed
    assert m.lookup(m.prompt([1, 2, 3, 4, 5])) == 2
    assert free_ids(m) == before and all(b.ref_cnt == 0 for b in m.blocks)


def test_external_blocks_get_new_rows_registered_and_grow_adds_the_rest():
    m = BlockManager(8, 2)
    run(m, "a", [1, 2, 3, 4, 5])
    m.free("a")
    p = m.prompt([1, 2, 3, 4, 5, 6, 7, 8, 9])  # 4 full blocks, cap 4; the pool holds 2
    assert m.lookup(p) == 2
    a = m.allocate("b", prompt=p, num_external=1, num_blocks=3)  # a lower tier holds block 2
    assert a.num_gpu_hit_blocks == 2 and a.num_cached_tokens == 6 and len(a.block_ids) == 3
    assert [pos for pos, _, _ in a.external] == [2]
    assert m.cached[a.external[0][2]].block_id == a.external[0][1]
    new = m.grow("b")
    assert len(new) == 2 and m.block_ids("b") == a.block_ids + new
    m.invalidate("b", 2)  # the load of block 2 failed: nobody may hit its row
    assert a.external[0][2] not in m.cached


def test_resident_and_free_window_orders():
    m = BlockManager(6, 2)
    run(m, "a", [1, 2, 3, 4])
    run(m, "b", [5, 6, 7])
    m.free("a")
    ha, hb = m.block_hashes("b"), None
    # in use first (b's full block), then free blocks most recently freed first (a: 0 was freed last)
    assert m.resident()[0] == (m.block_ids("b")[0], ha[0])
    assert [bid for bid, _ in m.resident()[1:]] == [0, 1]
    assert m.free_window(10) == [(1, m.blocks[1].block_hash), (0, m.blocks[0].block_hash)]
    assert m.free_window(2) == []  # the two next to be reused were never hashed
    del hb


def test_out_of_blocks_changes_nothing():
    m = BlockManager(4, 2)
    run(m, "a", [1, 2, 3, 4])
    m.free("a")
    before = (free_ids(m), dict(m.cached), {b.block_id: b.ref_cnt for b in m.blocks})
    with pytest.raises(OutOfBlocksError):
        run(m, "b", [1, 2, 3, 4] + list(range(10, 17)))  # needs 5 blocks with hit on block 0
    assert (free_ids(m), dict(m.cached), {b.block_id: b.ref_cnt for b in m.blocks}) == before
    assert "b" not in m.requests
    run(m, "c", [5, 6, 7])
    with pytest.raises(OutOfBlocksError):
        m.append("c", list(range(20)))
    assert m.num_tokens("c") == 3


def test_seed_n4_fork_and_cow():
    """Seed 5: a 40-token prompt (3 blocks of 16, last half full), n=4 fork, COW of b12."""
    m = BlockManager(32, 16)
    prompt = list(range(40))
    a = run(m, "seq0", prompt)
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
    run(m, "a", [1, 2, 3])
    m.append("a", [4, 5])  # block 0 becomes full
    assert m.num_cached_blocks == 0  # hashed, registered once its KV is written
    m.commit("a")
    h = BlockHasher(4).hash_blocks([1, 2, 3, 4])
    assert m.block_hashes("a") == h and m.cached[h[0]].block_id == m.block_ids("a")[0]
    m.free("a")
    b = run(m, "b", [1, 2, 3, 4, 9])
    assert b.num_cached_tokens == 4


def test_full_shared_last_block_needs_no_cow():
    m = BlockManager(8, 2)
    run(m, "a", [1, 2, 3, 4])
    m.fork("a", "b")
    assert m.append("a", [5]) == []
    assert m.block_ids("a")[:2] == m.block_ids("b")


def test_cache_salt_isolation():
    m = BlockManager(32, 4)
    toks = list(range(40))
    a = run(m, "a", toks, cache_salt="tenant-a")
    b = run(m, "b", toks, cache_salt="tenant-b")
    assert b.num_cached_tokens == 0 and not set(a.block_ids) & set(b.block_ids)
    c = run(m, "c", toks, cache_salt="tenant-a")
    assert c.num_cached_tokens == 36


def test_lora_isolation():
    m = BlockManager(32, 4)
    toks = list(range(40))
    a = run(m, "a", toks, lora_id="sql-adapter")
    b = run(m, "b", toks, lora_id="chat-adapter")
    n = run(m, "n", toks)
    assert b.num_cached_tokens == 0 and n.num_cached_tokens == 0
    assert not set(a.block_ids) & set(b.block_ids) & set(n.block_ids)


def test_block_hashes_instead_of_tokens():
    m = BlockManager(8, 4)
    hs = [bytes([i]) * 32 for i in range(3)]  # the hasher's length (sha256)
    run(m, "a", block_hashes=hs)
    m.free("a")
    b = run(m, "b", block_hashes=hs)  # no token count: every named block may hit
    assert b.num_cached_tokens == 12 and b.block_ids == [0, 1, 2]
    m.free("b")
    capped = run(m, "capped", block_hashes=hs, num_tokens=12)  # 12 tokens: cap (12-1)//4 = 2
    assert capped.num_cached_tokens == 8
    m.free("capped")
    c = run(m, "c", block_hashes=hs[:2], num_tokens=10)
    assert c.num_cached_tokens == 8 and len(c.block_ids) == 3
    with pytest.raises(ValueError, match="block_hashes"):
        run(m, "d", block_hashes=[hs[0], hs[0]])


@pytest.mark.parametrize("bad", [b"x" * 31, b"x" * 33, b"x" * 600, "x" * 32])
def test_block_hashes_of_another_length_are_refused(bad):
    """A hash of another length cannot come from this hasher, and one past the SSD tier's
    key limit used to reach its writer and switch it off."""
    m = BlockManager(8, 4)
    with pytest.raises(ValueError, match=r"block_hashes\[1\]: expected 32 bytes"):
        run(m, "a", block_hashes=[b"y" * 32, bad])
    assert m.num_free_blocks == 8 and "a" not in m.requests


def test_bad_arguments():
    m = BlockManager(4, 2)
    with pytest.raises(ValueError, match="token_ids"):
        run(m, "a", [])
    run(m, "a", [1])
    with pytest.raises(ValueError, match="request_id"):
        run(m, "a", [1])
    with pytest.raises(ValueError, match="request_id"):
        m.free("zzz")
    with pytest.raises(ValueError, match="child_request_id"):
        m.fork("a", "a")
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 2)


@pytest.mark.parametrize("bad", [-1, 2**32, "7", 1.5])
def test_a_bad_token_changes_nothing(bad):
    """``append`` used to take blocks and extend the tokens before the hasher refused the
    token; a bad token in a prompt's partial last block was accepted."""
    m = BlockManager(8, 4)
    run(m, "a", list(range(6)))
    before = (m.num_free_blocks, list(m.requests["a"].tokens), m.block_ids("a"))
    with pytest.raises(ValueError, match="token_ids"):
        m.append("a", [1, 2, 3, bad])
    assert (m.num_free_blocks, list(m.requests["a"].tokens), m.block_ids("a")) == before
    assert m.append("a", [6, 7, 8]) == [] and m.requests["a"].num_tokens == 9
    with pytest.raises(ValueError, match="token_ids"):
        run(m, "b", [1, 2, 3, 4, 5, bad])
    assert "b" not in m.requests
