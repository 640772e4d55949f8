"""Random allocate/commit/append/fork/free against a plain reference model (Hypothesis)."""
from __future__ import annotations

import math

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstrata import BlockHasher, BlockManager, OutOfBlocksError

NUM_BLOCKS, BS = 10, 2
HASHER = BlockHasher(BS)


class RefModel:
    """The documented semantics, written as plainly as possible (lists, no links)."""

    def __init__(self) -> None:
        self.free = list(range(NUM_BLOCKS))
        self.hash = [None] * NUM_BLOCKS
        self.ref = [0] * NUM_BLOCKS
        self.cached: dict[bytes, int] = {}
        self.reqs: dict[str, dict] = {}
        self.evicted: list[int] = []

    def _pop(self) -> int:
        b = self.free.pop(0)
        if self.hash[b] is not None:
            if self.cached.get(self.hash[b]) == b:
                del self.cached[self.hash[b]]
            self.hash[b] = None
            self.evicted.append(b)
        self.ref[b] = 1
        return b

    def _register(self, b: int, h: bytes) -> None:
        if h not in self.cached and self.hash[b] is None:
            self.cached[h] = b
            self.hash[b] = h

    def allocate(self, rid, toks, salt):
        hashes = HASHER.hash_blocks(toks, cache_salt=salt)
        hits = []
        for h in hashes[: (len(toks) - 1) // BS]:
            if h not in self.cached:
                break
            hits.append(self.cached[h])
        need = math.ceil(len(toks) / BS) - len(hits)
        if need > len(self.free) - sum(1 for b in hits if self.ref[b] == 0):
            raise OutOfBlocksError
        for b in hits:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1
        table = list(hits)
        for _ in range(len(hits), math.ceil(len(toks) / BS)):
            table.append(self._pop())
        self.reqs[rid] = dict(toks=list(toks), table=table, salt=salt, committed=len(hits))
        return table, len(hits) * BS

    def commit(self, rid):
        """Register the request's full blocks (its KV is written); report each computed one once."""
        r = self.reqs[rid]
        hashes = HASHER.hash_blocks(r["toks"], cache_salt=r["salt"])
        out = []
        for i in range(r["committed"], len(hashes)):
            self._register(r["table"][i], hashes[i])
            out.append((r["table"][i], hashes[i]))
        r["committed"] = max(r["committed"], len(hashes))
        return out

    def append(self, rid, new):
        r = self.reqs[rid]
        n = len(r["toks"])
        cow = n % BS != 0 and self.ref[r["table"][-1]] > 1
        extra = math.ceil((n + len(new)) / BS) - len(r["table"])
        if extra + cow > len(self.free):
            raise OutOfBlocksError
        ops = []
        if cow:
            old = r["table"][-1]
            nb = self._pop()
            ops.append((old, nb))
            r["table"][-1] = nb
            self.ref[old] -= 1
        for _ in range(extra):
            r["table"].append(self._pop())
        r["toks"] += new
        return ops

    def fork(self, parent, child):
        r = self.reqs[parent]
        for b in r["table"]:
            self.ref[b] += 1
        self.reqs[child] = dict(toks=list(r["toks"]), table=list(r["table"]), salt=r["salt"],
                                committed=r["committed"])

    def free_req(self, rid):
        """Last block first; unhashed blocks to the head (in that order), hashed to the tail."""
        first = []
        for b in reversed(self.reqs.pop(rid)["table"]):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash[b] is None:
                    first.append(b)
                else:
                    self.free.append(b)
        self.free[:0] = first


# few distinct prefixes so that prompts share blocks often
PROMPTS = st.builds(lambda p, tail: [p, p + 1, p + 2, p + 3][: 1 + p % 4] + tail,
                    st.integers(0, 3), st.lists(st.integers(0, 2), max_size=5))


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.evicted: list[int] = []
        self.m = BlockManager(NUM_BLOCKS, BS, hasher=HASHER, on_evict=lambda b, h: self.evicted.append(b))
        self.ref = RefModel()
        self.n = 0

    def _same_outcome(self, real, model):
        try:
            expected = model()
        except OutOfBlocksError:
            try:
                real()
            except OutOfBlocksError:
                return None
            raise AssertionError("model ran out of blocks, manager did not")
        return expected, real()

    @rule(toks=PROMPTS, salt=st.sampled_from([None, None, "t1"]))
    def allocate(self, toks, salt):
        if not toks:
            return
        rid = f"r{self.n}"
        self.n += 1
        out = self._same_outcome(lambda: self.m.allocate(rid, toks, cache_salt=salt),
                                 lambda: self.ref.allocate(rid, toks, salt))
        if out:
            (table, cached), a = out
            assert a.block_ids == table and a.num_cached_tokens == cached

    @precondition(lambda self: self.ref.reqs)
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def append(self, data, new):
        rid = data.draw(st.sampled_from(sorted(self.ref.reqs)))
        out = self._same_outcome(lambda: self.m.append(rid, new), lambda: self.ref.append(rid, new))
        if out:
            assert out[0] == out[1]

    @precondition(lambda self: self.ref.reqs)
    @rule(data=st.data())
    def commit(self, data):
        rid = data.draw(st.sampled_from(sorted(self.ref.reqs)))
        assert self.m.commit(rid) == self.ref.commit(rid)

    @precondition(lambda self: self.ref.reqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.ref.reqs)))
        child = f"r{self.n}"
        self.n += 1
        self.m.fork(parent, child)
        self.ref.fork(parent, child)

    @precondition(lambda self: self.ref.reqs)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.ref.reqs)))
        self.m.free(rid)
        self.ref.free_req(rid)

    @invariant()
    def matches_model(self):
        m, ref = self.m, self.ref
        assert [b.block_id for b in m.free_queue] == ref.free
        assert {h: b.block_id for h, b in m.cached.items()} == ref.cached
        assert [b.ref_cnt for b in m.blocks] == ref.ref
        assert {r: m.block_ids(r) for r in m.requests} == {r: v["table"] for r, v in ref.reqs.items()}
        assert self.evicted == ref.evicted

    @invariant()
    def structural_invariants(self):
        m = self.m
        in_free = {b.block_id for b in m.free_queue}
        holders = [0] * NUM_BLOCKS
        for rid in m.requests:
            for bid in set(m.block_ids(rid)):
                holders[bid] += m.block_ids(rid).count(bid)
        for b in m.blocks:
            # each block is in exactly one of: the free queue, some block table
            assert (b.block_id in in_free) != (holders[b.block_id] > 0), b
            assert b.ref_cnt == holders[b.block_id], b
        # no hash maps to a block whose tokens differ
        for rid, req in m.requests.items():
            hashes = HASHER.hash_blocks(req.tokens, cache_salt=req.cache_salt)
            for i, h in enumerate(hashes):
                blk = m.blocks[m.block_ids(rid)[i]]
                assert blk.block_hash in (None, h)
                if h in m.cached and m.cached[h].ref_cnt > 0 and m.cached[h] is blk:
                    assert blk.block_hash == h
        for h, b in m.cached.items():
            assert b.block_hash == h


BlockManagerMachine.TestCase.settings = settings(max_examples=500, stateful_step_count=40, deadline=None)
TestBlockManagerStateMachine = BlockManagerMachine.TestCase
