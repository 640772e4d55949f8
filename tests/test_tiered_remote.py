"""TieredKVCache with a remote tier on a real Valkey server: two caches (two replicas,
separate SSD directories) share blocks byte for byte; the server down at start-up or
killed mid-run costs misses, never an error."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from kvstrata import TieredKVCache
from kvstrata.config.schema import KVStrataConfig
from kvstrata.errors import ConfigError
from kvstrata.core.deployment import policy_spec

sys.path.insert(0, str(Path(__file__).parent))
from valkey_server import ValkeyServer, free_port, secret_file  # noqa: E402

NB = 4096
BS = 4


def config(tmp: Path, name: str, url: str, metrics: dict | None = None, **remote) -> KVStrataConfig:
    return KVStrataConfig.from_dict({
        "block_size": BS, "model": {"block_nbytes": NB, "id": "test-model"},
        "gpu": {"num_blocks": 64, "device": "cpu"}, "cpu": {"capacity": NB * 32},
        "ssd": {"path": str(tmp / name), "capacity": "64MiB"},
        "remote": {"url": url, "timeout": 0.3, "connect_timeout": 0.3, "secret_file": secret_file(tmp), **remote},
        **({"metrics": metrics} if metrics else {})})


def compute(cache: TieredKVCache, req: str, tokens: list[int], seed: int = 0) -> torch.Tensor:
    """Allocate, 'compute' the uncached blocks (random bytes), commit, free; returns the
    request's rows as they are in the pool."""
    alloc = cache.allocate(req, tokens)
    alloc.wait()
    n = alloc.num_cached_tokens // BS
    gen = torch.Generator().manual_seed(seed)
    fresh = torch.randint(0, 255, (len(alloc.block_ids) - n, NB), dtype=torch.uint8, generator=gen)
    cache.kv_pool[alloc.block_ids[n:]] = fresh
    cache.commit(req)
    rows = cache.kv_pool[alloc.block_ids].clone()
    cache.free(req)
    return rows


@pytest.fixture
def server():
    with ValkeyServer() as s:
        yield s


def test_a_second_replica_serves_the_first_ones_prefix_from_the_remote_tier(server, tmp_path) -> None:
    a = TieredKVCache(config(tmp_path, "a", server.url))
    b = TieredKVCache(config(tmp_path, "b", server.url))
    tokens = list(range(40))
    rows = compute(a, "r", tokens)
    a.flush()
    partial = tokens[:22] + [999] * 18  # shares 5 whole blocks with a's prompt
    alloc = b.allocate("p", partial)
    alloc.wait()
    assert alloc.hit_blocks == {"gpu": 0, "cpu": 0, "ssd": 0, "remote": 5}
    assert torch.equal(b.kv_pool[alloc.block_ids[:5]], rows[:5])
    b.free("p")
    alloc = b.allocate("q", tokens)  # the 5 fetched are now local (CPU); the other 4 come remote
    alloc.wait()
    assert alloc.hit_blocks["remote"] == 4 and alloc.num_cached_tokens == 36
    assert torch.equal(b.kv_pool[alloc.block_ids[:9]], rows[:9])
    assert b.stats()["remote"]["hits"] == 9 and b.stats()["hits"]["remote"]["blocks"] == 9
    assert b.ssd.flush() and len(list(b.ssd.keys())) >= 9  # write-through: fetched blocks persist locally
    a.close(), b.close()


def test_a_server_down_at_start_up_and_killed_mid_run_costs_misses(tmp_path) -> None:
    port = free_port()
    a = TieredKVCache(config(tmp_path, "a", f"redis://127.0.0.1:{port}/0"))  # nobody listens
    tokens = list(range(40))
    compute(a, "r", tokens)
    assert a.flush() is True
    with ValkeyServer(port=port) as server:
        b = TieredKVCache(config(tmp_path, "b", server.url))
        alloc = b.allocate("r", tokens)
        assert alloc.num_cached_tokens == 0  # a's writes were dropped while the server was down
        b.free("r")
        rows = compute(a, "s", tokens, seed=1)  # a's breaker probes its way back ...
        deadline = time.monotonic() + 10
        while a.remote.breaker.state != "closed" and time.monotonic() < deadline:
            a.remote.probe([b"x" * 32])
            time.sleep(0.1)
        compute(a, "t", list(range(100, 140)))  # ... and later blocks are written
        a.flush()
        other = b.allocate("t", list(range(100, 140)))
        assert other.hit_blocks["remote"] == 9
        b.free("t")
        server.kill()
        start = time.monotonic()
        alloc = b.allocate("u", list(range(200, 240)))
        assert time.monotonic() - start < 2.0 and alloc.num_cached_tokens == 0
        del rows
        b.close()
    a.close()


@pytest.mark.parametrize("cpu", [0, 1000])
def test_a_remote_tier_without_a_cpu_tier_is_a_config_error(tmp_path, cpu) -> None:
    """Fetches land in CPU slots: a CPU tier of no block (none, or smaller than one block) is refused."""
    from kvstrata.policy import PolicySpec

    cfg = KVStrataConfig.from_dict({"cpu": {"capacity": cpu}, "remote": {"url": "redis://127.0.0.1:1/0"}})
    with pytest.raises(ConfigError, match="^cpu.capacity: the shared tier fetches blocks into"):
        policy_spec(cfg, block_nbytes=4096, gpu_blocks=8)


def test_the_remote_tier_is_in_the_metrics(server, tmp_path) -> None:
    import urllib.request

    a = TieredKVCache(config(tmp_path, "a", server.url))
    b = TieredKVCache(config(tmp_path, "b", server.url, metrics={"port": 0, "host": "127.0.0.1"}))
    try:
        compute(a, "r", list(range(40)))
        a.flush()
        compute(b, "r", list(range(40)))
        deadline = time.monotonic() + 15
        while not b.stats()["remote"]["server"] and time.monotonic() < deadline:
            time.sleep(0.05)  # the writer thread reads the server's INFO on its first turn
        port = b._metrics_server.server_port
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        a.close(), b.close()
    lines = dict(ln.rsplit(" ", 1) for ln in body.splitlines() if ln and not ln.startswith("#"))
    assert float(lines['kvstrata:remote_operations_total{outcome="hits"}']) == 9  # a's blocks but the last token's
    assert float(lines['kvstrata:remote_bytes_total{direction="read"}']) >= 9 * NB
    assert lines["kvstrata:remote_breaker_open"] == "0.0"
    assert float(lines['kvstrata:remote_server_memory_bytes{kind="max"}']) == 256 * 1024**2
    assert float(lines['kvstrata:promotions_total{tier="remote"}']) == 9
    # the library exports a prefix hit per tier its stats count, the remote tier's included
    assert float(lines['kvstrata:prefix_cache_hits_blocks_total{tier="remote"}']) == 9
