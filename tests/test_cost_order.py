"""The ``cost`` eviction order (kvstrata.policy.cost_eviction) against a plain reference:
Marconi's score over every entry, recomputed at each eviction."""

from __future__ import annotations

import hashlib
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata import KVStrataConfig, TieredKVCache
from kvstrata.errors import ConfigError
from kvstrata.policy import PolicySpec, TierPolicy
from kvstrata.policy.orders import OrderContext
from kvstrata.policy.positions import CLASSES, Positions
from kvstrata.policy.slot_index import SlotIndex
from kvstrata.core.deployment import policy_spec

K = [hashlib.sha256(b"%d" % i).digest() for i in range(512)]
RHO = 0.05  # a block of 4 tokens: w(p) = 1 + 0.2 (p + 1/2), from 1.1 to 9.1 over 40 positions


def position(r: int) -> int:
    return (r * 7) % 40


def book() -> Positions:
    """K[r] reaches block ``position(r)``."""
    positions = Positions(4, RHO)
    for r in range(41):
        positions.keep(K[r], position(r))
    return positions


def run(index: SlotIndex, requests: list[int]) -> list[bool]:
    hits = []
    for r in requests:
        hit = K[r] in index
        if hit:
            index.touch(K[r])
        else:
            index.allocate(K[r])
        hits.append(hit)
    index.check()
    return hits


def reference(capacity: int, alpha: float, requests: list[int]) -> list[bool]:
    """Every entry's score, ``(last use - oldest) / (now - oldest) + alpha x 2^((class - top) / 4)``,
    the lowest evicted (ties: the cheaper class, then the older)."""
    last: dict[int, int] = {}
    tick = 0
    hits = []

    def klass(r: int) -> int:
        w = 1 + RHO * 4 * (position(r) + 0.5)
        return min(CLASSES - 1, int(4 * math.log2(w)))

    for r in requests:
        hits.append(r in last)
        if r not in last and len(last) >= capacity:
            oldest = min(last.values())
            span = float(tick - oldest) or 1.0
            top = max(klass(x) for x in last)
            victim = min(last, key=lambda x: ((last[x] - oldest) / span + alpha * 2.0 ** ((klass(x) - top) / 4)
                                              if alpha else last[x], klass(x) if alpha else 0, last[x]))
            del last[victim]
        tick += 1
        last[r] = tick
    return hits


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 24), alpha=st.sampled_from([0.0, 0.25, 1.0, 4.0]),
       requests=st.lists(st.integers(0, 40), min_size=1, max_size=400))
def test_cost_serves_as_the_reference_does(capacity: int, alpha: float, requests: list[int]) -> None:
    assert run(SlotIndex(capacity, f"cost:{alpha}", OrderContext(reaches=book())), requests) == reference(capacity, alpha, requests)


@settings(max_examples=100, deadline=None)
@given(capacity=st.integers(1, 24), requests=st.lists(st.integers(0, 40), min_size=1, max_size=400))
def test_cost_with_no_weight_is_lru(capacity: int, requests: list[int]) -> None:
    assert run(SlotIndex(capacity, "cost:0", OrderContext(reaches=book())), requests) == run(SlotIndex(capacity, "lru"), requests)


def test_a_late_block_outlives_an_early_one_used_more_recently_as_alpha_grows() -> None:
    """K[0] at position 0 (w 1.1, class 0), K[1] at position 7 (w 2.5, class 5); K[1] used
    first. Recency: K[1] 0, K[0] 1; efficiency: K[1] 1, K[0] 2^(-5/4) = 0.42. K[1] stays once
    alpha x (1 - 0.42) outweighs the whole span of recency: alpha > 1.72."""
    for alpha, survivor in ((0.0, K[0]), (1.0, K[0]), (1.7, K[0]), (1.8, K[1]), (4.0, K[1])):
        index = SlotIndex(2, f"cost:{alpha}", OrderContext(reaches=book()))
        index.allocate(K[1])
        index.allocate(K[0])
        index.allocate(K[2])
        assert survivor in index, alpha


def test_a_prompt_reaches_its_last_block_and_an_unknown_key_takes_the_mean_reach() -> None:
    positions = Positions(4, RHO)
    positions.note(K[:9])          # a prompt of 9 blocks: each reaches block 8
    positions.note(K[:3])          # a shorter one through the same prefix: the last prompt decides
    assert [positions.of(k) for k in K[:9]] == [2] * 3 + [8] * 6
    positions.note(K[20:25], count=3)  # the first 3 blocks of a longer list
    assert positions.of(K[22]) == 2 and positions.of(K[23]) is None
    stranger = b"s" * 32
    klass, reach = positions.klass(stranger)  # the mean of 8, 2, 2 (2 and 8 are 4 classes apart)
    assert reach == -1 and positions.klass(K[0])[0] < klass < positions.klass(K[3])[0]
    index = SlotIndex(4, "cost", OrderContext(reaches=positions))
    index.allocate(stranger)
    positions.note([K[30], stranger, *K[31:60]])
    index.touch(stranger)  # a use looks the class of an unknown key up again
    assert index._lru._class[stranger] % CLASSES == positions.klass(stranger)[0] > positions.klass(K[0])[0]


def test_a_victim_keeps_its_reach_for_the_tier_below() -> None:
    """The CPU tier's cost order evicts K[0], K[1]; the SSD tier's cost order places them by
    the reach the CPU order kept, after the book forgot it."""
    cfg = KVStrataConfig.from_dict({}, {"cpu.capacity": 4096 * 2, "ssd.capacity": 4096 * 64, "ssd.path": "/x",
                                        "cpu.eviction": "cost", "ssd.eviction": "cost",
                                        "spill.write_through": False})
    policy = TierPolicy(policy_spec(cfg, block_nbytes=4096, gpu_blocks=8))
    positions = policy.order_context.book
    assert positions is not None
    positions.limit = 4
    positions.keep(K[0], 30)
    positions.keep(K[1], 31)
    policy.complete_store(policy.prepare_store([0, 1], K[:2], "computed"))  # K[0], K[1] at 30, 31 in DRAM
    for n in range(2):
        positions.note([b"x%d-%d" % (n, i) + b"0" * 28 for i in range(4)])  # two generations: K[:2] forgotten
    assert positions.of(K[0]) is None
    positions.note(K[2:4])
    policy.complete_store(policy.prepare_store([2, 3], K[2:4], "computed"))  # K[0], K[1] cascade to the SSD tier
    assert K[0] in policy.store and K[1] in policy.store
    assert [policy.store._lru._class[k] // CLASSES - 1 for k in K[:2]] == [30, 31]
    policy.check()


def test_the_library_teaches_the_order_the_reach_of_what_it_looks_up(tmp_path) -> None:
    cfg = KVStrataConfig.from_dict({"block_size": 4, "model": {"block_nbytes": 4096}, "gpu": {"num_blocks": 8,
                                                                                                "device": "cpu"}},
                                   {"cpu.capacity": 4096 * 16, "ssd.capacity": 0, "cpu.eviction": "cost:1"})
    tokens = list(range(2, 2 + 6 * 4 + 1))
    with TieredKVCache(cfg) as cache:
        cache.allocate("a", tokens).wait()
        cache.commit("a")
        cache.free("a")
        cache.flush()
        positions = cache.policy.order_context.book
        assert positions is not None and positions.block_tokens == 4
        held = [k for k in cache.policy.slab]
        assert [positions.of(k) for k in held] == [5] * 6


@pytest.mark.parametrize("value", ["cost:", "cost:x", "cost:-1", "cost:nan", "cost:101"])
def test_a_malformed_weight_is_a_config_error_naming_the_key(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^ssd\.eviction: expected cost or cost:<weight from 0 to 100>"):
        KVStrataConfig.from_dict({}, {"ssd.eviction": value})


def test_an_absurd_attention_share_is_ignored() -> None:
    positions = Positions(4, RHO)
    for absurd in (float("inf"), float("nan"), -1.0, 1e300):
        positions.rho = absurd
        assert positions.rho == RHO
    positions.note(K[:3])
    assert positions.klass(K[0])[1] == 2
