"""kvstrata as SGLang's HiCache storage backend, driven through SGLang 0.5.23's own classes.

The backend is created by SGLang's real ``StorageBackendFactory`` from the dynamic extra
config and registered with SGLang's real ``MHATokenToKVPoolHost`` over CPU tensors (its
device pool, ``MHATokenToKVPool``, is built on the CPU: only its geometry and pointer tables
are read). The SSD tier is a real LMDB environment in ``tmp_path``. Calls come as SGLang's
cache controller makes them: batches of up to 128 pages, v1 (zero copy) and generic; the
controller itself drives the backend in tests/test_sglang_controller.py.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from sglang_env import create_backend, fill, host_pool, page_bytes, sglang  # noqa: E402

from kvstrata.errors import ConfigError  # noqa: E402

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
BATCH = 128  # SGLang's STORAGE_BATCH_SIZE


def keys_of(n: int, seed: str = "a") -> list[str]:
    return [hashlib.sha256(f"{seed}/{i}".encode()).hexdigest() for i in range(n)]


def extra(tmp: Path, name: str = "ssd", **more) -> dict:
    return {"ssd.path": str(tmp / name), "ssd.capacity": "64MiB", "model.id": "test-model", **more}


def test_the_factory_loads_the_backend_from_the_dynamic_extra_config(tmp_path) -> None:
    host = host_pool("page_first")
    backend = create_backend(extra(tmp_path), host)
    hicache = sglang().hicache_storage
    assert isinstance(backend, hicache.HiCacheStorage) and type(backend).__name__ == "KVStrataStorage"
    assert backend.backend.interface_v1 and backend.backend.config.cpu.capacity == 0  # SGLang's pool is the DRAM tier
    assert (tmp_path / "ssd" / "rank-0" / "data.mdb").exists()  # rank 0's own directory
    backend.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_written_by_batch_set_v1_come_back_byte_exact_into_other_slots(tmp_path, layout) -> None:
    host = host_pool(layout, device_tokens=600, ratio=2.0)  # 1,200 tokens: 300 pages of 4
    backend = create_backend(extra(tmp_path), host)
    n = 140
    src = host.alloc(n * host.page_size)
    fill(host, src, seed=1)
    keys = keys_of(n)
    for lo in range(0, n, BATCH):  # the controller's batches: 128, then 12
        part = src[lo * host.page_size:min(n, lo + BATCH) * host.page_size]
        assert backend.batch_set_v1(keys[lo:lo + BATCH], part) == [True] * len(keys[lo:lo + BATCH])
    dst = host.alloc(BATCH * host.page_size)  # other slots than the written ones
    assert set(dst.tolist()).isdisjoint(src.tolist())
    assert backend.batch_exists(keys[:BATCH]) == BATCH and backend.batch_exists(keys[BATCH:]) == n - BATCH
    assert backend.batch_get_v1(keys[:BATCH], dst) == [True] * BATCH
    assert page_bytes(host, dst) == page_bytes(host, src)[:BATCH]
    backend.close()


@pytest.mark.parametrize("layout", ("layer_first", "page_first"))
def test_a_new_backend_on_the_same_ssd_path_serves_the_pages_after_a_restart(tmp_path, layout) -> None:
    host = host_pool(layout)
    first = create_backend(extra(tmp_path), host)
    src = host.alloc(16 * host.page_size)
    fill(host, src, seed=2)
    written = page_bytes(host, src)
    keys = keys_of(16)
    assert all(first.batch_set_v1(keys, src))
    first.close()
    host = host_pool(layout)  # a new process: a fresh pool, the same directory
    again = create_backend(extra(tmp_path), host)
    assert again.batch_exists(keys) == 16
    dst = host.alloc(16 * host.page_size)
    assert again.batch_get_v1(keys, dst) == [True] * 16
    assert page_bytes(host, dst) == written
    assert again.get_stats().kvstrata["hits"]["ssd"]["blocks"] == 16
    again.close()


def test_the_generic_path_and_the_zero_copy_path_store_the_same_pages(tmp_path) -> None:
    host = host_pool("layer_first")
    backend = create_backend(extra(tmp_path), host)
    src = host.alloc(8 * host.page_size)
    fill(host, src, seed=3)
    written = page_bytes(host, src)
    keys = keys_of(8)
    flat = [host.get_data_page(s) for s in src[::host.page_size].tolist()]  # as _generic_page_set sends them
    assert backend.batch_set(keys[:4], flat[:4]) is True
    assert all(backend.batch_set_v1(keys[4:], src[4 * host.page_size:]))
    dst = host.alloc(8 * host.page_size)
    assert backend.batch_get_v1(keys, dst) == [True] * 8  # written generic, read zero copy
    assert page_bytes(host, dst) == written
    targets = [host.get_dummy_flat_data_page() for _ in keys]
    got = backend.batch_get(keys, targets)  # written zero copy, read generic
    assert [g.view(torch.uint8).numpy().tobytes() for g in got] == written
    assert backend.get(keys[0], host.get_dummy_flat_data_page()).view(torch.uint8).numpy().tobytes() == written[0]
    assert backend.exists(keys[7]) and not backend.exists(keys_of(1, "other")[0])
    backend.close()


def test_batch_exists_returns_the_leading_run_and_a_gap_ends_it(tmp_path) -> None:
    host = host_pool("page_first")
    backend = create_backend(extra(tmp_path), host)
    src = host.alloc(10 * host.page_size)
    fill(host, src, seed=4)
    keys = keys_of(10)
    held = keys[:4] + keys[5:]  # page 4 never stored
    ids = torch.cat([src[:4 * host.page_size], src[5 * host.page_size:]])
    assert all(backend.batch_set_v1(held, ids))
    assert backend.batch_exists(keys) == 4
    assert backend.batch_exists(keys[5:]) == 5
    assert backend.batch_exists([]) == 0
    dst = host.alloc(10 * host.page_size)
    assert backend.batch_get_v1(keys, dst) == [True] * 4 + [False] * 6  # up to the gap, as SGLang reads
    backend.close()


def damage(ssd: Path, payload: bytes) -> None:
    """Flip one byte of a stored page in place (stored raw, compression none: small pages lie
    in the index, ``data.mdb``, larger ones in ``blocks.dat``)."""
    for name in ("blocks.dat", "data.mdb"):
        path = ssd / "rank-0" / name
        data = path.read_bytes()
        at = data.find(payload[:128])
        if at >= 0:
            with open(path, "r+b") as f:
                f.seek(at + 100)
                f.write(bytes([data[at + 100] ^ 0x10]))
            return
    raise AssertionError("the page is not on disk")


def test_a_damaged_page_is_a_counted_miss_never_served(tmp_path) -> None:
    host = host_pool("page_first")
    backend = create_backend(extra(tmp_path, **{"ssd.compression": "none"}), host)
    src = host.alloc(6 * host.page_size)
    fill(host, src, seed=5)
    written = page_bytes(host, src)
    keys = keys_of(6)
    assert all(backend.batch_set_v1(keys, src)) and backend.flush()
    damage(tmp_path / "ssd", written[3])
    dst = host.alloc(6 * host.page_size)
    before = page_bytes(host, dst)
    assert backend.batch_get_v1(keys, dst) == [True] * 3 + [False] * 3
    assert page_bytes(host, dst)[:3] == written[:3]
    assert page_bytes(host, dst)[3] != written[3]  # never the damaged bytes as a hit
    assert backend.flush()  # the SSD writer deletes the bad record (and counts it) on its thread
    stats = backend.get_stats().kvstrata
    assert stats["ssd"]["corrupt_deleted"] == 1 and stats["corrupt_blocks"]["ssd"] == 1
    assert backend.batch_exists(keys) == 3  # forgotten: recomputed and stored again next time
    assert before is not None
    backend.close()


def test_bad_keys_are_refused_without_touching_stored_pages(tmp_path) -> None:
    host = host_pool("page_first")
    backend = create_backend(extra(tmp_path), host)
    src = host.alloc(4 * host.page_size)
    fill(host, src, seed=6)
    written = page_bytes(host, src)
    keys = keys_of(4)
    assert all(backend.batch_set_v1(keys, src))
    bad = ["", "xyz", keys[0][:-1], keys[0] + "00", keys[0][:-1] + "g", None, 7, keys[0] + ".mamba"]
    other = host.alloc(len(bad) * host.page_size)
    fill(host, other, seed=7)
    assert backend.batch_set_v1(bad, other) == [False] * len(bad)
    assert backend.batch_set(bad[:2], [host.get_dummy_flat_data_page()] * 2) is False
    mixed = [keys[0], keys[1], "not-a-key", keys[3]]
    assert backend.batch_exists(mixed) == 2
    dst = host.alloc(4 * host.page_size)
    assert backend.batch_get_v1(mixed, dst) == [True, True, False, False]
    assert backend.batch_get_v1(keys, dst) == [True] * 4
    assert page_bytes(host, dst) == written  # the stored pages are untouched
    assert backend.get_stats().kvstrata["refused_keys"] >= len(bad)
    backend.close()


def test_a_host_indices_batch_that_does_not_match_the_pool_is_refused(tmp_path) -> None:
    host = host_pool("page_first")
    backend = create_backend(extra(tmp_path), host)
    keys = keys_of(2)
    ps = host.page_size
    for indices in (torch.arange(ps), torch.arange(3 * ps), torch.arange(1, 2 * ps + 1),
                    torch.tensor([0, 1, 2, 3, 8, 10, 9, 11]), torch.arange(2 * ps).float(),
                    torch.arange(host.size, host.size + 2 * ps), torch.arange(2 * ps).view(2, ps)):
        assert backend.batch_set_v1(keys, indices) == [False, False]
        assert backend.batch_get_v1(keys, indices) == [False, False]
    assert backend.batch_exists(keys) == 0  # nothing was stored
    backend.close()


def test_the_ssd_tier_stays_within_its_capacity_evicting_by_the_policy(tmp_path) -> None:
    host = host_pool("page_first", heads=8, head_dim=64, page_size=16, device_tokens=960, ratio=2.0)  # 64 KiB pages
    backend = create_backend(extra(tmp_path, **{"ssd.capacity": "1MiB"}), host)
    capacity = backend.store.policy.capacity()["ssd"]
    assert 4 <= capacity < 16
    n = 40
    src = host.alloc(n * host.page_size)
    fill(host, src, seed=8)
    keys = keys_of(n)
    ps = host.page_size
    for lo in range(0, n, 8):  # batches smaller than the tier: the least recently used pages make room
        assert all(backend.batch_set_v1(keys[lo:lo + 8], src[lo * ps:(lo + 8) * ps]))
    assert backend.flush()
    assert backend.batch_exists(keys) == 0  # the oldest pages went first
    assert backend.batch_exists(keys[n - capacity:]) == capacity
    stats = backend.get_stats().kvstrata
    assert stats["occupancy"]["ssd"] == capacity and stats["evictions"]["ssd"] == n - capacity
    ssd = backend.store.executor.persistent  # the tier's own view: records on disk and their bytes
    assert len(list(ssd.keys())) == capacity
    assert 0 < stats["ssd"]["current_bytes"] <= stats["ssd"]["capacity_bytes"] <= 1024**2
    more = keys_of(capacity + 5, "more")  # one batch larger than the tier: what fits is taken
    assert backend.batch_set_v1(more, src[:len(more) * ps]) == [True] * capacity + [False] * 5
    assert backend.get_stats().kvstrata["dropped_spills"]["ssd"] == 5
    backend.close()


def test_get_stats_is_sglangs_storage_metrics_with_kvstrata_counters(tmp_path) -> None:
    host = host_pool("page_first")
    backend = create_backend(extra(tmp_path), host)
    src = host.alloc(8 * host.page_size)
    keys = keys_of(8)
    backend.batch_set_v1(keys, src)
    backend.batch_get_v1(keys, host.alloc(8 * host.page_size))
    metrics = backend.get_stats()
    assert isinstance(metrics, sglang().metrics_collector.StorageMetrics)
    assert metrics.backup_pgs == [8] and metrics.prefetch_pgs == [8] and metrics.prefetch_bandwidth[0] > 0
    assert metrics.kvstrata["executor"]["blocks_stored_ssd"] == 8
    assert backend.get_stats().prefetch_pgs == []  # samples since the last call
    backend.close()


# ------------------------------------------------------------------------- bad configuration

@pytest.mark.parametrize("bad, named", [
    ({"ssd.capacty": "1GiB"}, "ssd.capacty: unknown key; did you mean 'capacity'"),
    ({"ssd.capacity": [1]}, "ssd.capacity: expected a size"),
    ({"remote.timeout": "soon"}, "remote.timeout"),
    ({"block_size": 16}, "block_size: not used under SGLang"),
    ({"gpu.num_blocks": 16}, "gpu.num_blocks: not used under SGLang"),
    ({"spill.admission": "on_evict"}, "spill.admission: not used under SGLang"),
    ({"interface_v1": "yes"}, "interface_v1: expected 0 or 1"),
    ({"ssd.path": None}, "ssd.path: no tier below SGLang's host pool"),
])
def test_bad_extra_config_is_one_error_naming_the_key_at_construction(tmp_path, bad, named) -> None:
    host = host_pool("page_first")
    with pytest.raises(ConfigError, match="hicache-storage-backend-extra-config: " + named.replace("(", r"\(")):
        create_backend({**extra(tmp_path), **bad}, host)
    assert not (tmp_path / "ssd").exists()  # refused before anything was opened


def test_ssd_path_is_required_and_the_model_must_be_identifiable(tmp_path) -> None:
    host = host_pool("page_first")
    with pytest.raises(ConfigError, match="ssd.path: required"):
        create_backend({"model.id": "m"}, host)
    with pytest.raises(ConfigError, match="model.id: cannot identify"):
        create_backend({"ssd.path": str(tmp_path / "s")}, host, model_name="no/such-model-here")


def test_a_layout_kvstrata_cannot_serve_is_refused_at_registration_naming_it(tmp_path) -> None:
    host = host_pool("page_head")
    with pytest.raises(ConfigError, match=r"'page_head'.*layer_first, page_first, page_first_direct"):
        create_backend(extra(tmp_path), host)


def test_vllm_and_sglang_tiers_never_share_a_namespace(tmp_path) -> None:
    from kvstrata.connectors.sglang.pools import host_pages, sglang_fingerprint

    host = host_pool("page_first")
    config = sglang().hicache_storage.HiCacheStorageConfig(0, 1, 0, 1, 0, 1, False, False, True, "m")
    fp = sglang_fingerprint("id:m", host_pages(host), config)
    assert fp.kv_layout == "sglang:page_first" and fp.variant.startswith("sglang:")
    other = sglang_fingerprint("id:m", host_pages(host_pool("layer_first")), config)
    assert other.tier_id() != fp.tier_id()  # the layout is part of the identity too
