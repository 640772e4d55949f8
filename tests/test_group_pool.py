"""The grouped block pool (kvstrata.pool.grouped), the replay's model of vLLM's hybrid
allocator, on hand-made sequences; ``tests/test_parity.py`` and
``tests/test_recorder_vllm.py`` check it against vLLM's real scheduler."""

from __future__ import annotations

import pytest

from kvstrata.pool.blocks import Prompt
from kvstrata.config.schema import ConfigError, KVStrataConfig
from kvstrata.identity.groups import FULL, SLIDING, STATE, Group, KVGroups
from kvstrata.errors import OutOfBlocksError
from kvstrata.pool.grouped import GroupedBlockManager

BS = 4
GROUPS = KVGroups([Group(FULL), Group(SLIDING, 2 * BS)], BS)  # a hit needs the 2 blocks before it


def key(g: int, i: int) -> bytes:
    return bytes([g, i])


def prompt(blocks: int, extra: int = 1) -> Prompt:
    n = blocks * BS + extra
    return Prompt([bytes([0, i]) for i in range(blocks)], n, min((n - 1) // BS, blocks))


def test_a_window_caches_only_the_blocks_a_later_hit_can_use() -> None:
    pool = GroupedBlockManager(32, GROUPS)
    pool.allocate("a", prompt=prompt(6), key=key)
    computed = pool.commit("a")
    assert [k for _, k in computed] == [key(g, i) for g in (0, 1) for i in range(6)]  # every block is offered
    pool.free("a")
    # full attention keeps all 6, the window only the 2 before the prompt's last hit point
    assert sorted(pool.cached) == sorted([key(0, i) for i in range(6)] + [key(1, 4), key(1, 5)])
    assert pool.lookup(prompt(6), key) == 6
    assert pool.lookup(prompt(4), key) == 0  # full attention holds 4 blocks, the window before 4 is gone


def test_a_junction_the_full_groups_hold_keeps_its_window_and_a_key_may_name_two_rows() -> None:
    pool = GroupedBlockManager(32, GROUPS)
    pool.allocate("a", prompt=prompt(6), key=key)
    pool.commit("a")
    pool.free("a")
    # a prompt sharing 4 blocks: the device can serve none of it (no window before 4), so
    # the 4 blocks come from below, into new rows that cache the junction's window too
    alloc = pool.allocate("b", prompt=prompt(4, extra=3), key=key, num_external=4)
    assert alloc.num_gpu_hit_blocks == 0 and alloc.block_ids[1][:2] == [0, 0]  # the window skips 2 blocks
    assert len(pool.cached[key(0, 0)]) == 2  # the loaded copy beside the old one
    assert key(1, 2) in pool.cached and key(1, 3) in pool.cached
    pool.free("b")
    assert pool.lookup(prompt(4, extra=3), key) == 4


def test_rows_go_back_in_vllms_order_and_evictions_are_reported() -> None:
    pool = GroupedBlockManager(12, GROUPS, track_evictions=True)
    pool.allocate("a", prompt=prompt(5, extra=2), key=key)
    pool.commit("a")
    pool.free("a")
    queue = [b.block_hash for b in pool.free_queue]
    # unhashed first (each group's partial block; the window's blocks no hit can use, freed
    # when the request finished), then full attention's blocks last first, then the window's
    # kept ones last first
    assert queue[:5] == [None] * 5
    assert queue[5:] == [key(0, i) for i in (4, 3, 2, 1, 0)] + [key(1, i) for i in (4, 3)]
    with pytest.raises(OutOfBlocksError):
        pool.allocate("big", prompt=prompt(6, extra=1), key=lambda g, i: bytes([g, 200 + i]))  # 14 rows
    assert [b.block_hash for b in pool.free_queue] == queue
    pool.allocate("b", prompt=prompt(3, extra=1), key=lambda g, i: bytes([g, 100 + i]))  # 8 rows
    assert [k for _, k in pool.take_evicted()] == [key(0, 4), key(0, 3), key(0, 2)]
    assert pool.lookup(prompt(2), key) == 0 and key(0, 1) in pool.cached


def test_decode_frees_what_the_window_left_behind_and_takes_new_rows() -> None:
    pool = GroupedBlockManager(32, GROUPS)
    p = Prompt([bytes([0, i]) for i in range(4)], 4 * BS + 3, 4)  # a prompt of 9 tokens, 10 more decoded
    pool.allocate("a", prompt=p, key=key, prefill=2 * BS + 1)
    assert [len(t) for t in pool.requests["a"].tables] == [3, 3]
    pool.commit("a")
    steps = pool.decode_steps("a")
    assert steps[0] == 2 * BS + 1 and steps[-1] < p.num_tokens
    for t in steps:
        pool.decode("a", t)
    ids = pool.block_ids("a")
    assert 0 not in ids[0] and ids[1][:2] == [0, 0]  # the window freed blocks 0 and 1 as decode went on
    assert len(ids[0]) == len(ids[1]) == 5  # 19 tokens
    assert sorted(k for k in pool.cached if k[0] == 0) == [key(0, i) for i in range(4)]


STATES = KVGroups([Group(FULL), Group(STATE)], BS)  # vLLM's align mode: a state per block position


def test_a_state_group_prefills_in_chunks_that_end_where_a_hit_can_and_caches_the_state_there() -> None:
    """As vLLM's scheduler runs a 6-block prompt (plus 3 tokens) alone: a first chunk of 6 blocks,
    the state after it in a row at position 5 (null rows before), then the last tokens, whose
    running state takes the next position; only the state at 5 is cached (and offered)."""
    pool = GroupedBlockManager(32, STATES)
    p = prompt(6, extra=3)
    pool.allocate("a", prompt=p, key=key)
    ids = pool.block_ids("a")
    assert len(ids[0]) == 6 and ids[1][:5] == [0] * 5 and ids[1][5] != 0
    assert [k for _, k in pool.commit("a")] == [key(0, i) for i in range(6)] + [key(1, 5)]
    assert pool.advance("a") and not pool.advance("a")
    ids = pool.block_ids("a")
    assert len(ids[0]) == 7 and ids[1][:5] == [0] * 5 and 0 not in ids[1][5:]  # the last state and the running one
    assert pool.commit("a") == []
    pool.free("a")
    assert sorted(pool.cached) == sorted([key(0, i) for i in range(6)] + [key(1, 5)])
    assert pool.lookup(p, key) == 6
    assert pool.lookup(prompt(4, extra=3), key) == 0  # full attention holds 4 blocks, no state after 4
    again = pool.allocate("b", prompt=prompt(8, extra=1), key=key)  # a longer prompt: hit 6, chunk to 8 blocks
    assert again.num_gpu_hit_blocks == 6
    ids = pool.block_ids("b")
    assert ids[1][:5] == [0] * 5 and ids[1][5] != 0 and ids[1][6] == 0 and ids[1][7] != 0


def test_a_shared_prefix_junction_ends_a_chunk_and_its_state_is_cached() -> None:
    """A prompt sharing 2 blocks with a cached one that holds no state there: no hit, but the
    prefill stops at the junction, so the state after 2 blocks is cached for its siblings; the
    state before is freed (hashed: to the free queue's tail) once the next chunk ran."""
    pool = GroupedBlockManager(32, STATES)
    pool.allocate("a", prompt=prompt(6, extra=3), key=key)
    pool.commit("a")
    pool.free("a")

    def other(g: int, i: int) -> bytes:
        return key(g, i) if i < 2 else bytes([g, 100 + i])

    p = Prompt([other(0, i) for i in range(4)], 4 * BS + 2, 4)
    assert pool.lookup(p, other) == 0
    pool.allocate("b", prompt=p, key=other)
    assert [len(t) for t in pool.requests["b"].tables] == [2, 2]  # the first chunk ends at the junction
    assert [k for _, k in pool.commit("b")] == [other(0, 0), other(0, 1), other(1, 1)]
    junction_row = pool.block_ids("b")[1][1]
    assert pool.advance("b")  # to the last block boundary before the last token
    assert [k for _, k in pool.commit("b")] == [other(0, 2), other(0, 3), other(1, 3)]
    assert pool.advance("b")  # the last tokens: the state at the junction is freed now
    assert pool.block_ids("b")[1][1] == 0 and pool.blocks[junction_row].ref_cnt == 0
    assert [b.block_id for b in pool.free_queue][-1] == junction_row  # cached: at the tail
    pool.free("b")
    sibling = Prompt([other(0, 0), other(0, 1), bytes([0, 200])], 3 * BS + 1, 3)
    assert pool.lookup(sibling, lambda g, i: other(g, i) if i < 2 else bytes([g, 200])) == 2


@pytest.mark.parametrize("retention, cached", [(0, [2]), (None, [2, 3, 4]), (3 * BS, [2])])
def test_decode_moves_the_running_state_on_and_caches_it_as_the_retention_says(retention: int | None,
                                                                              cached: list[int]) -> None:
    """Decode takes a row for each block it enters and frees the one before; with vLLM's
    default retention (0) no decode state is cached, dense retention caches each, an
    interval the states ending one (positions 2, 5, ...)."""
    pool = GroupedBlockManager(32, KVGroups([Group(FULL), Group(STATE)], BS, retention))
    p = Prompt([bytes([0, i]) for i in range(5)], 5 * BS + 1, 3)  # 13 tokens of prompt, 8 more decoded
    pool.allocate("a", prompt=p, key=key, prefill=3 * BS + 1)
    pool.commit("a")
    while pool.advance("a"):
        pool.commit("a")
    for t in pool.decode_steps("a"):
        pool.decode("a", t)
    ids = pool.block_ids("a")  # 21 tokens: the state after 4 blocks, and the running one at 5
    assert [i for i, b in enumerate(ids[1]) if b] == [4, 5]
    pool.free("a")
    assert sorted(i for g, i in pool.cached if g == 1) == cached


def test_a_loaded_state_takes_one_row_at_the_hit_point() -> None:
    pool = GroupedBlockManager(32, STATES)
    alloc = pool.allocate("a", prompt=prompt(6, extra=3), key=key, num_external=4, num_blocks=4)
    assert alloc.block_ids[1] == [0, 0, 0, alloc.block_ids[1][3]] and alloc.block_ids[1][3] != 0
    assert [(i, k) for i, _, k in alloc.external] == [(i, key(0, i)) for i in range(4)] + [(3, key(1, 3))]
    assert key(1, 3) not in pool.cached  # a hit cannot end there later: not cached
    pool.grow("a")  # the first chunk computed after the load: to block 6
    ids = pool.block_ids("a")
    assert len(ids[0]) == 6 and ids[1][3] != 0 and ids[1][4] == 0 and ids[1][5] != 0
    assert [k for _, k in pool.commit("a")] == [key(0, 4), key(0, 5), key(1, 5)]


@pytest.mark.parametrize("value, error", [
    ("full,window:3", r"model\.groups\[1\]: 'window:3': KV-cache group kind 'window'"),
    ("sliding", r"model\.groups\[0\]: 'sliding': .*tokens 0"),
    ("sliding:x", r"model\.groups\[0\]: 'sliding:x': expected a window or chunk in tokens after the colon"),
    (["full", 3], r"model\.groups: expected a list of group kinds"),
])
def test_model_groups_name_what_is_wrong(value: object, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        KVStrataConfig.from_dict({"model": {"groups": value}})


def test_model_groups_are_normalised_and_size_a_row() -> None:
    plain = KVStrataConfig.from_dict({"model": {"layers": 6}})
    hybrid = KVStrataConfig.from_dict({"model": {"layers": 6, "groups": ["full", "sliding:512", "sliding:512"]}})
    assert hybrid.model.groups == "full,sliding:512,sliding:512"
    assert KVStrataConfig.from_dict({"model": {"groups": "full"}}).model.groups == ""
    # vLLM's hybrid allocator: a row holds one group's share of the layers
    assert hybrid.block_nbytes() * 3 == plain.block_nbytes()


@pytest.mark.parametrize("value, error", [
    (-16, r"model\.retention_interval"),
    ("often", r"model\.retention_interval"),
    (True, r"model\.retention_interval"),
])
def test_model_retention_interval_names_what_is_wrong(value: object, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        KVStrataConfig.from_dict({"model": {"groups": "full,sliding:64", "retention_interval": value}})


def test_model_retention_interval_is_vllms_setting() -> None:
    of = lambda v: KVStrataConfig.from_dict({"model": {"retention_interval": v}}).model.retention_interval  # noqa: E731
    assert KVStrataConfig.from_dict({}).model.retention_interval == 0  # vLLM's default
    assert of("dense") is None and of(None) is None and of(256) == 256
