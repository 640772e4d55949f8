"""Hybrid models under SGLang: a Mamba pool beside the KV pool (the v2 interface), with
SGLang 0.5.23's own ``MambaPoolHost`` and ``MHATokenToKVPoolHost`` over CPU tensors.

A hit may end only where every pool can restore: the KV pages from the first, a Mamba
state at the hit's last page. ``batch_exists_v2`` intersects the pools' legal end points;
taking the minimum of their longest prefixes (sglang#39147) can pick an end with no state.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from sglang_env import create_backend, fill, host_pool, mamba_pool, page_bytes, sglang  # noqa: E402

from kvstrata.connectors.kit.page_ends import common_ends, legal_ends  # noqa: E402
from kvstrata.errors import ConfigError  # noqa: E402


def keys_of(n: int, seed: str = "h") -> list[str]:
    return [hashlib.sha256(f"{seed}/{i}".encode()).hexdigest() for i in range(n)]


def hicache():
    return sglang().hicache_storage


def transfer(name, keys, indices=None, policy="trailing_pages"):
    h = hicache()
    return h.PoolTransfer(name=h.PoolName(name), keys=keys, host_indices=indices, hit_policy=h.PoolHitPolicy(policy))


def states(mamba, slots: list[int], seed: int) -> list[bytes]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in slots:
        page = mamba.get_dummy_flat_data_page()
        page.copy_(torch.randint(0, 256, (page.numel(),), dtype=torch.uint8, generator=gen))
        mamba.set_from_flat_data_page(s, page)
        out.append(mamba.get_data_page(s).numpy().tobytes())
    return out


@pytest.fixture
def hybrid(tmp_path):
    host, mamba = host_pool("page_first"), mamba_pool()
    backend = create_backend({"ssd.path": str(tmp_path / "ssd"), "ssd.capacity": "64MiB", "model.id": "m"}, host)
    backend.register_mem_host_pool_v2(mamba, hicache().PoolName.MAMBA)
    backend.on_host_pools_registered()
    yield backend, host, mamba
    backend.close()


def store_case(backend, host, mamba, keys: list[str], kv_pages: list[int], state_pages: list[int]) -> None:
    """KV pages ``kv_pages`` of ``keys`` and the states after pages ``state_pages``."""
    ps = host.page_size
    src = host.alloc(len(keys) * ps)
    fill(host, src, seed=31)
    ids = torch.cat([src[i * ps:(i + 1) * ps] for i in kv_pages])
    assert all(backend.batch_set_v1([keys[i] for i in kv_pages], ids))
    slots = mamba.alloc(len(state_pages))
    states(mamba, slots.tolist(), seed=32)
    done = backend.batch_set_v2([transfer("mamba", [keys[i] for i in state_pages], slots)])
    assert done == {"mamba": [True] * len(state_pages)}


def test_sglang_39147_the_hit_is_the_last_end_point_every_pool_shares_not_the_minimum(hybrid, tmp_path) -> None:
    backend, host, mamba = hybrid
    keys = keys_of(6)
    store_case(backend, host, mamba, keys, kv_pages=[0, 1, 2, 4, 5], state_pages=[1, 4])  # KV: 3 pages, then a gap
    query = [transfer("mamba", [keys[-1]])]  # the state at the hit's last page
    result = backend.batch_exists_v2(keys, query)
    # KV restores ends 1..3, the states ends 2 and 5: the minimum of the longest prefixes, 3,
    # has no state; the shared ends are {2}
    assert result.kv_hit_pages == 2 and result.restorable_prefix_pages == [2]
    assert result.extra_pool_hit_pages == {"kv": 3, "mamba": 2}
    minimum = min(3, 5)  # the pools' longest prefixes: KV pages to 3, states to 5
    assert minimum != result.kv_hit_pages
    assert backend.batch_exists_v2(keys[:2], query).kv_hit_pages == 2
    assert backend.batch_exists_v2(keys[:1], query).kv_hit_pages == 0  # no state after page 0


def test_sglangs_file_backend_answers_the_same_case_in_0_5_23(tmp_path) -> None:
    """The file backend's batch_exists_v2 (SGLang 0.5.23) on the same pages: recorded beside
    kvstrata's answer, so a change in either shows."""
    h = hicache()
    host, mamba = host_pool("page_first"), mamba_pool()
    from sglang_env import storage_config

    file = h.HiCacheFile(storage_config({"file_storage_path": str(tmp_path / "file")}), str(tmp_path / "file"))
    file.register_mem_pool_host(host)
    file.register_mem_host_pool_v2(host, h.PoolName.KV)
    file.register_mem_host_pool_v2(mamba, h.PoolName.MAMBA)
    keys = keys_of(6)
    ps = host.page_size
    src = host.alloc(6 * ps)
    fill(host, src, seed=31)
    for i in (0, 1, 2, 4, 5):
        assert file.set(keys[i], host.get_data_page(int(src[i * ps]), flat=True))
    slots = mamba.alloc(2)
    assert file.batch_set_v2([transfer("mamba", [keys[1], keys[4]], slots)]) == {"mamba": [True, True]}
    result = file.batch_exists_v2(keys, [transfer("mamba", [keys[-1]])])
    assert result.kv_hit_pages == 2 and result.restorable_prefix_pages == [2]


def test_state_pages_round_trip_byte_exact_beside_the_kv_pages(hybrid) -> None:
    backend, host, mamba = hybrid
    keys = keys_of(4)
    ps = host.page_size
    src = host.alloc(4 * ps)
    fill(host, src, seed=33)
    slots = mamba.alloc(2)
    written = states(mamba, slots.tolist(), seed=34)
    done = backend.batch_set_v2([transfer("kv", keys, src, "all_pages"), transfer("mamba", keys[2:], slots)])
    assert done == {"kv": [True] * 4, "mamba": [True, True]}
    assert backend.batch_exists_v2(keys, [transfer("mamba", keys[-1:])]).restorable_prefix_pages == [3, 4]
    dst, other = host.alloc(4 * ps), mamba.alloc(2)
    got = backend.batch_get_v2([transfer("kv", keys, dst, "all_pages"), transfer("mamba", keys[2:], other)])
    assert got == {"kv": [True] * 4, "mamba": [True, True]}
    assert page_bytes(host, dst) == page_bytes(host, src)
    assert [mamba.get_data_page(s).numpy().tobytes() for s in other.tolist()] == written
    stats = backend.get_stats().kvstrata
    assert stats["pools"]["mamba"]["executor"]["blocks_stored_ssd"] == 2


def test_a_pool_that_needs_every_page_cuts_at_its_first_gap(hybrid) -> None:
    backend, host, mamba = hybrid
    keys = keys_of(5)
    store_case(backend, host, mamba, keys, kv_pages=[0, 1, 2, 3, 4], state_pages=[0, 2, 3])
    result = backend.batch_exists_v2(keys, [transfer("mamba", keys, policy="all_pages")])
    assert result.kv_hit_pages == 1 and result.restorable_prefix_pages == [1]
    window = backend.batch_exists_v2(keys, [transfer("mamba", keys[-2:])])  # the last two pages' states
    assert window.restorable_prefix_pages == [1, 4] and window.kv_hit_pages == 4
    last = backend.batch_exists_v2(keys, [transfer("mamba", keys[-1:])])
    assert last.restorable_prefix_pages == [1, 3, 4] and last.kv_hit_pages == 4


def test_bad_v2_calls_are_misses_and_a_pool_before_the_kv_pool_is_refused(hybrid, tmp_path) -> None:
    backend, host, mamba = hybrid
    keys = keys_of(2)
    assert backend.batch_set_v2([transfer("mamba", keys, torch.tensor([0]))]) == {"mamba": [False, False]}
    assert backend.batch_set_v2([transfer("swa", keys, torch.tensor([0, 1]))]) == {"swa": [False, False]}
    assert backend.batch_get_v2([transfer("mamba", ["not-a-key"], mamba.alloc(1))]) == {"mamba": [False]}
    assert backend.batch_exists_v2(keys, [transfer("swa", keys[-1:])]).kv_hit_pages == 0  # no such pool: no end
    from sglang_env import DYNAMIC, storage_config

    fresh = type(backend)(storage_config({**DYNAMIC, "ssd.path": str(tmp_path / "s2"), "model.id": "m"}), {})
    with pytest.raises(ConfigError, match="register_mem_pool_host"):
        fresh.register_mem_host_pool_v2(mamba, hicache().PoolName.MAMBA)
    fresh.close()


def test_legal_ends_and_their_intersection() -> None:
    held = [True, False, True, True, False, True]
    assert legal_ends(held, 6) == {1}
    assert legal_ends(held, 6, window=1) == {1, 3, 4, 6}
    assert legal_ends(held, 6, window=2) == {1, 4}  # a window reaching before the first page: what there is
    assert legal_ends(held, 3, window=1) == {1, 3}
    assert common_ends([{1, 2, 3}, {2, 5}]) == [2] and common_ends([{1}, set()]) == [] and common_ends([]) == []
    with pytest.raises(ValueError, match="window"):
        legal_ends(held, 6, window=0)
