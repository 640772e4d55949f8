"""Eviction orders (kvstrata.policy.eviction) against plain reference implementations."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.config.schema import KVStrataConfig
from kvstrata.errors import ConfigError
from kvstrata.policy import PolicySpec, TierPolicy
from kvstrata.policy.eviction import ARCOrder, S3FIFOOrder
from kvstrata.policy.slot_index import SlotIndex
from kvstrata.core.deployment import policy_spec

K = [hashlib.sha256(b"%d" % i).digest() for i in range(512)]


def run(index: SlotIndex, requests: list[int]) -> list[bool]:
    """A cache of ``index``'s slots serving ``requests``: a hit is a use, a miss is placed."""
    hits = []
    for r in requests:
        key = K[r]
        hit = key in index
        if hit:
            index.touch(key)
        else:
            index.allocate(key)
        hits.append(hit)
    index.check()
    return hits


# ---------------------------------------------------------------------------- references

def s3fifo_reference(capacity: int, requests: list[int]) -> list[bool]:
    """S3-FIFO as the paper describes it, on plain lists (small = 10% of the slots, a
    ghost as large as the main FIFO, a 2-bit count, move to main when used once)."""
    small_cap = max(1, int(0.1 * capacity))
    small: list[int] = []
    main: list[int] = []
    ghost: list[int] = []
    freq: dict[int, int] = {}
    hits = []

    def evict() -> None:
        while True:
            if small and (len(small) >= small_cap or not main):
                t = small.pop(0)
                if freq[t] >= 1:
                    freq[t] = 0
                    main.append(t)
                    continue
                del freq[t]
                ghost.append(t)
                if len(ghost) > capacity - small_cap:
                    ghost.pop(0)
                return
            t = main.pop(0)
            if freq[t] > 0:
                freq[t] -= 1
                main.append(t)
                continue
            del freq[t]
            return

    for r in requests:
        if r in freq:
            freq[r] = min(freq[r] + 1, 3)
            hits.append(True)
            continue
        hits.append(False)
        if len(small) + len(main) >= capacity:
            evict()
        freq[r] = 0
        if r in ghost:
            ghost.remove(r)
            main.append(r)
        else:
            small.append(r)
    return hits


def arc_reference(c: int, requests: list[int]) -> list[bool]:
    """ARC as Megiddo and Modha's figure 4 gives it (cases I to IV, REPLACE)."""
    t1: list[int] = []
    t2: list[int] = []
    b1: list[int] = []
    b2: list[int] = []
    p = 0.0
    hits = []

    def replace(x: int) -> None:
        if t1 and (len(t1) > p or (x in b2 and len(t1) == int(p)) or not t2):
            b1.append(t1.pop(0))
        else:
            b2.append(t2.pop(0))

    for x in requests:
        if x in t1 or x in t2:  # case I
            (t1 if x in t1 else t2).remove(x)
            t2.append(x)
            hits.append(True)
            continue
        hits.append(False)
        if x in b1:  # case II
            p = min(float(c), p + max(len(b2) / len(b1), 1.0))
            replace(x)
            b1.remove(x)
            t2.append(x)
        elif x in b2:  # case III
            p = max(0.0, p - max(len(b1) / len(b2), 1.0))
            replace(x)
            b2.remove(x)
            t2.append(x)
        else:  # case IV
            if len(t1) + len(b1) == c:
                if len(t1) < c:
                    b1.pop(0)
                    replace(x)
                else:
                    t1.pop(0)
            elif len(t1) + len(t2) + len(b1) + len(b2) >= c:
                if len(t1) + len(t2) + len(b1) + len(b2) == 2 * c:
                    b2.pop(0)
                if len(t1) + len(t2) >= c:
                    replace(x)
            t1.append(x)
    return hits


requests_st = st.lists(st.integers(0, 40), min_size=1, max_size=400)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 24), requests=requests_st)
def test_s3fifo_serves_as_the_reference_does(capacity: int, requests: list[int]) -> None:
    assert run(SlotIndex(capacity, "s3fifo"), requests) == s3fifo_reference(capacity, requests)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 24), requests=requests_st)
def test_arc_serves_as_the_reference_does(capacity: int, requests: list[int]) -> None:
    assert run(SlotIndex(capacity, "arc"), requests) == arc_reference(capacity, requests)


@settings(max_examples=100, deadline=None)
@given(capacity=st.integers(1, 24), requests=requests_st)
def test_lru_is_the_lru_stack(capacity: int, requests: list[int]) -> None:
    """LRU hits exactly when the stack distance is within the capacity (the exact curve's rule)."""
    stack: list[int] = []
    want = []
    for r in requests:
        want.append(r in stack and stack.index(r) < capacity)
        if r in stack:
            stack.remove(r)
        stack.insert(0, r)
    assert run(SlotIndex(capacity, "lru"), requests) == want


# ---------------------------------------------------------------------------- hand-made sequences

def test_s3fifo_sends_one_hit_wonders_out_first_and_keeps_what_was_used() -> None:
    index = SlotIndex(10, "s3fifo")  # a small FIFO of one slot
    run(index, [0, 0])  # 0 is used while in the small FIFO
    run(index, list(range(1, 12)))  # a scan of one-hit wonders
    assert K[0] in index  # moved to the main FIFO, it outlives the scan
    assert K[1] not in index


def test_s3fifo_takes_a_ghost_hit_straight_into_the_main_fifo() -> None:
    order = S3FIFOOrder(10)
    for k in K[:3]:
        order.add(k)
    assert order.evict(None) == K[0]  # the small FIFO's head, unused: to the ghost
    order.add(K[0])
    assert K[0] in order._main and K[0] not in order._small


def test_arc_adapts_its_target_toward_the_list_whose_ghost_was_hit() -> None:
    order = ARCOrder(4)
    for k in K[:4]:
        order.add(k)
    order.access(K[2])
    order.access(K[3])  # used twice: on to T2
    victim = order.evict(K[4])
    assert victim == K[0] and K[0] in order._b1
    order.add(K[4])
    order.evict(K[0])  # K[0] comes back: a hit in B1 raises p (recency was worth more)
    order.add(K[0])
    assert order.p == 1.0 and K[0] in order._t2


def test_pins_keep_an_entry_from_eviction_and_count_as_a_use() -> None:
    for policy in ("s3fifo", "arc", "lru"):
        index = SlotIndex(2, policy)
        index.allocate(K[0])
        index.allocate(K[1])
        index.pin(K[0])
        slot, evicted = index.allocate(K[2])
        assert evicted == K[1], policy
        index.unpin(K[0])
        index.check()


def test_every_order_holds_what_the_policy_placed_and_keeps_its_invariants() -> None:
    cfg = KVStrataConfig.from_dict({}, {"cpu.capacity": 4096 * 8, "ssd.capacity": 4096 * 64, "cpu.eviction": "s3fifo",
                                        "ssd.eviction": "arc", "spill.write_through": False, "ssd.path": "/x"})
    policy = TierPolicy(policy_spec(cfg, block_nbytes=4096, gpu_blocks=8))
    for i in range(200):
        keys = [K[(i * 7 + j) % 100] for j in range(4)]
        plan = policy.prepare_store(list(range(4)), keys, "computed")
        policy.complete_store(plan)
        older = [K[(i * 13 + j) % 100] for j in range(4)]  # a prefix from further back
        found = policy.lookup(older)
        if found:
            load = policy.prepare_load("r", older[:len(found)], list(range(len(found))))
            policy.complete_load(load)
        policy.check()
    assert policy.counts.counts["evicted"]["cpu"] > 0 and policy.counts.counts["hit"]["ssd"] > 0


@pytest.mark.parametrize("key", ["cpu.eviction", "ssd.eviction"])
def test_an_unknown_eviction_is_a_config_error_naming_the_key_and_the_choices(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{key}: expected one of lru, s3fifo, arc, cost; got 'lfu'"):
        KVStrataConfig.from_dict({}, {key: "lfu"})


def test_arc_counts_a_ghost_hit_once_when_a_batch_places_several() -> None:
    """A batch evicts for all its keys before it adds them: each ghost hit adapts ``p`` once."""
    one, batch = SlotIndex(4, "arc"), SlotIndex(4, "arc")
    for index in (one, batch):
        index.allocate_many(K[:4])
        index.touch_many(K[:2])            # K0, K1 to T2
        index.allocate_many(K[4:6])        # K2, K3 leave T1 for B1
    one.allocate_many([K[2]])
    one.allocate_many([K[3]])
    batch.allocate_many([K[2], K[3]])
    assert batch._lru.p == one._lru.p == 2.0  # +1 per hit in B1 (|B2| = 0 < |B1|)
    batch._lru.check()


@pytest.mark.parametrize("pinned", [True, False])
@pytest.mark.parametrize("policy", ["s3fifo", "arc"])
def test_renaming_to_a_key_the_order_remembers_as_a_ghost_leaves_one_entry(policy: str, pinned: bool) -> None:
    index = SlotIndex(2, policy)
    index.allocate(K[0])
    index.touch(K[0])
    index.allocate(K[1])
    index.allocate(K[2])  # K1 leaves, remembered by the order's ghost
    assert K[1] not in index
    if pinned:
        index.pin(K[2])
    index.rename(K[2], K[1])
    index._lru.check()
    if pinned:
        index.unpin(K[1])
    index.check()
    index._lru.check()
    assert len(index._lru) == len(index) == 2


@pytest.mark.parametrize("policy", ["s3fifo", "arc"])
def test_a_batch_with_a_present_key_keeps_its_order_and_stays_linear(policy: str) -> None:
    index = SlotIndex(8, policy)
    old = [b"old%d" % i for i in range(8)]
    index.allocate_many(old)
    new = [b"new%d" % i for i in range(6)]
    index.allocate_many([old[7], *new])
    order = [k for k in index if k.startswith(b"new")]
    assert order == new  # the batch's keys enter in the batch's order
    index.check()
