"""TieredKVCache on the CPU device with a real CPU slab and a real LMDB SSD tier."""
from __future__ import annotations

import dataclasses
import hashlib
import random
import urllib.request

import pytest
import numpy as np
import torch

from kvstrata import OutOfBlocksError, KVStrataConfig, TieredKVCache

BS, NBYTES = 4, 256


ADMISSIONS = ("on_compute", "on_evict")


def config(tmp_path, *, gpu=16, cpu=24, ssd="8MiB", admission="on_compute", **extra):
    spill = {"admission": admission, **({"watermark": 0.125} if admission == "on_evict" else {})}
    d = {"block_size": BS, "model": {"block_nbytes": NBYTES},
         "cpu": {"capacity": cpu * NBYTES}, "ssd": {"path": str(tmp_path / "ssd"), "capacity": ssd},
         "spill": spill}
    if gpu is not None:  # None: the caller passes its own kv_pool
        d["gpu"] = {"num_blocks": gpu}
    for k, v in extra.items():
        d.setdefault(k, {}).update(v)
    return KVStrataConfig.from_dict(d)


def payload(h: bytes) -> bytes:
    """Deterministic block content derived from the block hash."""
    out = b""
    while len(out) < NBYTES:
        out += hashlib.sha256(h + len(out).to_bytes(4, "little")).digest()
    return out[:NBYTES]


class Driver:
    """Plays the engine: computes (writes) uncached blocks, checks every cached one."""

    def __init__(self, cache: TieredKVCache) -> None:
        self.cache = cache
        self.checked = {"gpu": 0, "cpu": 0, "ssd": 0}

    def run(self, rid: str, tokens: list[int], **kw):
        c = self.cache
        a = c.allocate(rid, tokens, **kw)
        a.wait()
        hashes = c.manager.requests[rid].hashes
        cached = a.num_cached_tokens // BS
        for pos in range(cached):
            got = self.get(a.block_ids[pos])
            assert got == payload(hashes[pos]), f"{rid}: block {pos} has another block's bytes"
        assert sum(a.hit_blocks.values()) == cached
        for t, n in a.hit_blocks.items():
            self.checked[t] += n
        for pos in range(cached, len(hashes)):  # "prefill" the rest
            self.put(a.block_ids[pos], payload(hashes[pos]))
        c.commit(rid)
        return a

    def get(self, block: int) -> bytes:
        return bytes(self.cache.kv_pool[block].cpu().numpy())

    def put(self, block: int, data: bytes) -> None:
        pool = self.cache.kv_pool
        pool[block] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(pool.device)

    def push_out(self, requests: int, tokens: int, base: int) -> None:
        """Run and free filler requests of fresh tokens, pushing older blocks down the tiers."""
        for i in range(requests):
            self.run(f"fill{base}-{i}", [base + 100 * i + j for j in range(tokens)])
            self.cache.free(f"fill{base}-{i}")


def chat(users: int, turns: int, seed: int = 0):
    """Multi-turn chat: each turn's prompt extends the user's previous prompt.

    Users are picked with skewed weights, so some come back while their blocks
    are still on the GPU, some after they reached the CPU tier, some later.
    """
    rng = random.Random(seed)
    history = {u: [u * 10_000 + i for i in range(rng.randint(9, 15))] for u in range(users)}
    weights = [1 / (u + 1) ** 1.2 for u in range(users)]
    for step in range(users * turns):
        u = rng.choices(range(users), weights)[0]
        yield f"u{u}s{step}", list(history[u])
        history[u] += [rng.randrange(5000) for _ in range(rng.randint(3, 9))]
        if len(history[u]) > 48:  # the conversation ends; the user starts a new one
            history[u] = [u * 10_000 + step * 100 + i for i in range(rng.randint(9, 15))]


@pytest.mark.parametrize("admission", ADMISSIONS)
def test_chat_overflows_gpu_then_cpu_and_every_hit_is_byte_exact(tmp_path, admission):
    with TieredKVCache(config(tmp_path, admission=admission)) as cache:
        d = Driver(cache)
        for rid, toks in chat(users=10, turns=5):
            d.run(rid, toks)
            cache.free(rid)
        s = cache.stats()
    assert all(d.checked[t] > 0 for t in ("gpu", "cpu", "ssd")), d.checked
    assert {t: s["hits"][t]["blocks"] for t in d.checked} == d.checked
    assert s["evictions"]["gpu"] > 0 and s["evictions"]["cpu"] > 0
    assert s["occupancy"]["cpu"] <= 24 and s["occupancy"]["gpu"] <= 16
    assert s["hits"]["cpu"]["tokens"] == d.checked["cpu"] * BS
    assert s["queries"]["blocks"] > sum(d.checked.values())
    if admission == "on_evict":
        assert s["spills_at_eviction"] < s["spills"]["cpu"] // 2, "the watermark should absorb most spills"
    else:
        assert s["spills_at_eviction"] == 0


@pytest.mark.parametrize("admission", ADMISSIONS)
def test_promoted_blocks_are_registered_on_gpu(tmp_path, admission):
    with TieredKVCache(config(tmp_path, gpu=8, admission=admission)) as cache:
        d = Driver(cache)
        toks = list(range(17))  # 4 full blocks
        d.run("a", toks)
        cache.free("a")
        d.push_out(3, 25, 50_000)  # push a's blocks out of the GPU pool
        b = d.run("b", toks)
        assert b.hit_blocks["gpu"] == 0 and b.hit_blocks["cpu"] == 4
        cache.free("b")
        c = d.run("c", toks)
        assert c.hit_blocks == {"gpu": 4, "cpu": 0, "ssd": 0}


@pytest.mark.parametrize("admission", ADMISSIONS)
def test_restart_serves_prefix_from_ssd(tmp_path, admission):
    toks = list(range(41))
    with TieredKVCache(config(tmp_path, admission=admission)) as cache:
        d = Driver(cache)
        d.run("a", toks)
        cache.free("a")
        d.push_out(6, 30, 90_000)
        cache.flush()
    with TieredKVCache(config(tmp_path, admission=admission)) as fresh:
        d = Driver(fresh)
        a = d.run("again", toks)
        assert a.hit_blocks == {"gpu": 0, "cpu": 0, "ssd": 10}
        assert a.num_cached_tokens == 40


@pytest.mark.parametrize("admission", ADMISSIONS)
def test_restart_serves_a_conversation_whose_system_prompt_never_left_the_gpu(tmp_path, admission):
    """Multi-turn chat on one shared system prompt that stays GPU-resident the whole run
    (hit by every turn, never evicted): after close() and a new cache on the same SSD path,
    the whole conversation prefix, system prompt included, is served from SSD, byte-exact."""
    system = list(range(1000, 1032))  # 8 full blocks
    rng = random.Random(7)
    users = {u: system + [20_000 + 100 * u + i for i in range(6)] for u in range(6)}
    cfg = config(tmp_path, gpu=24, cpu=8, admission=admission)
    with TieredKVCache(cfg) as cache:
        d = Driver(cache)
        for turn in range(4):
            for u, hist in users.items():
                d.run(f"u{u}t{turn}", hist)
                cache.free(f"u{u}t{turn}")
                hist += [rng.randrange(5000) for _ in range(5)]
        system_hashes = cache.hasher.hash_blocks(system)
        assert all(h in cache.manager.cached for h in system_hashes), "the system prompt stayed on the GPU"
    with TieredKVCache(cfg) as fresh:
        d = Driver(fresh)  # asserts every hit is byte-exact
        hist = users[0][:-5]  # user 0's last prompt: the whole conversation so far
        a = d.run("again", hist)
        assert a.hit_blocks["gpu"] == 0 and a.hit_blocks["ssd"] == (len(hist) - 1) // BS, a.hit_blocks


def test_corrupted_ssd_degrades_to_misses(tmp_path):
    toks = list(range(41))
    cfg = config(tmp_path, cpu=1)
    with TieredKVCache(cfg) as cache:
        d = Driver(cache)
        d.run("a", toks)
        cache.free("a")
        d.push_out(4, 30, 90_000)
        cache.flush()
    data = tmp_path / "ssd" / "data.mdb"
    raw = bytearray(data.read_bytes())
    rng = random.Random(1)
    for off in rng.sample(range(len(raw)), 4000):
        raw[off] ^= 0xFF
    data.write_bytes(bytes(raw))
    with TieredKVCache(cfg) as fresh:
        d = Driver(fresh)  # Driver asserts any hit is byte-exact
        a = d.run("again", toks)
        assert a.hit_blocks["ssd"] < 10
        fresh.free("again")
        d.run("again2", toks)
        fresh.stats()  # must not raise


def test_ssd_unwritable_midway_only_drops_spills(tmp_path):
    """The SSD tier's directory vanishes under a running cache: spills drop, nothing raises."""
    import shutil

    cfg = config(tmp_path, cpu=2)
    with TieredKVCache(cfg) as cache:
        d = Driver(cache)
        for rid, toks in chat(users=6, turns=2):
            d.run(rid, toks)
            cache.free(rid)
        shutil.rmtree(tmp_path / "ssd")
        for rid, toks in chat(users=6, turns=4, seed=1):
            d.run("x" + rid, toks)
            cache.free("x" + rid)
        cache.flush()


def test_exclusive_promotion_moves_blocks_out_of_cpu(tmp_path):
    cfg = config(tmp_path, gpu=8, ssd=0, admission="on_evict", spill={"promotion": "exclusive"})
    with TieredKVCache(cfg) as cache:
        d = Driver(cache)
        toks = list(range(13))
        d.run("a", toks)
        cache.free("a")
        d.push_out(3, 25, 50_000)
        hashes = cache.hasher.hash_blocks(toks)
        assert cache.policy.lookup(hashes) == ["cpu"] * 3
        b = d.run("b", toks)
        assert b.hit_blocks["cpu"] == 3
        assert cache.policy.lookup(hashes) == []


def test_out_of_blocks_leaves_no_pins(tmp_path):
    with TieredKVCache(config(tmp_path, gpu=6, ssd=0)) as cache:
        d = Driver(cache)
        toks = list(range(9))
        d.run("a", toks)
        cache.free("a")
        d.run("f", list(range(100, 121)))  # 6 blocks: all of the pool; a's blocks spill to CPU
        with pytest.raises(OutOfBlocksError):
            cache.allocate("b", toks)
        assert cache.policy.pinned() == {"cpu": 0, "ssd": 0}
        cache.free("f")
        assert d.run("b", toks).hit_blocks["cpu"] == 2


def test_cache_salt_never_shares_across_tiers(tmp_path):
    with TieredKVCache(config(tmp_path, gpu=8)) as cache:
        d = Driver(cache)
        toks = list(range(17))
        d.run("a", toks, cache_salt="tenant-a")
        cache.free("a")
        d.push_out(3, 25, 50_000)
        b = d.run("b", toks, cache_salt="tenant-b")
        assert b.num_cached_tokens == 0
        cache.free("b")
        c = d.run("c", toks, cache_salt="tenant-a")
        assert c.num_cached_tokens == 16


def test_metrics_endpoint_is_scrapable(tmp_path):
    cfg = config(tmp_path, metrics={"port": 0})
    cache = TieredKVCache(cfg)
    try:
        d = Driver(cache)
        for rid, toks in chat(users=6, turns=3):
            d.run(rid, toks)
            cache.free(rid)
        port = cache._metrics_server.server_port
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        cache.close()
    assert 'kvstrata:prefix_cache_hits_total{tier="cpu"}' in body or 'kvstrata:prefix_cache_hits_total{tier="gpu"}' in body
    for name in ("kvstrata:prefix_cache_queries_total", "kvstrata:spills_total", "kvstrata:occupancy_blocks",
                 "kvstrata:kv_block_reuse_gap_seconds_bucket", "kvstrata:kv_block_lifetime_seconds_count",
                 "kvstrata:transfer_bytes_total", "kvstrata:dropped_spills_total", "kvstrata:corrupt_blocks_total"):
        assert name in body, name
    queries = [ln for ln in body.splitlines() if ln.startswith("kvstrata:prefix_cache_queries_total")]
    assert float(queries[0].split()[-1]) > 0


@pytest.mark.parametrize("admission", ADMISSIONS)
def test_an_aborted_prefill_caches_nothing_in_any_tier(tmp_path, admission):
    """A request freed before its rows were written (an abort, a disconnect) used to leave
    hashed blocks holding whatever the rows held; they paged out to SSD and were served,
    even after a restart. Only committed blocks are ever cached."""
    prompt = list(range(500, 532))  # 8 full blocks
    with TieredKVCache(config(tmp_path, gpu=16, cpu=4, admission=admission)) as cache:
        a = cache.allocate("aborted", prompt)
        a.wait()
        for row in a.block_ids:
            cache.kv_pool[row] = 0xEE  # garbage, never the prompt's KV
        cache.free("aborted")
        d = Driver(cache)
        for u in range(6):  # pressure: everything on the GPU is evicted and paged out
            d.run(f"u{u}", [9000 + 100 * u + i for i in range(33)])
            cache.free(f"u{u}")
        again = d.run("again", prompt)
        assert again.num_cached_tokens == 0
        cache.free("again")
    with TieredKVCache(config(tmp_path, gpu=16, cpu=4, admission=admission)) as fresh:
        d = Driver(fresh)  # checks every served block against the bytes computed for its hash
        assert d.run("after-restart", prompt).num_cached_tokens == 28  # computed by "again"


def test_spills_never_push_the_ssd_tier_past_the_policys_plan(tmp_path):
    """Without write-through, blocks reach the SSD tier as spills of the CPU tier, each plan
    with the SSD evictions that make room for them. Spills used to be queued before those
    deletions: a writer batch taken in between found the tier over capacity, and its LRU
    backstop evicted blocks the policy still held (lost SSD hits)."""
    nbytes = 8192
    cfg = KVStrataConfig.from_dict({
        "block_size": 16, "model": {"block_nbytes": nbytes}, "gpu": {"num_blocks": 64, "device": "cpu"},
        "cpu": {"capacity": 32 * nbytes, "pin_memory": "false"},
        "ssd": {"path": str(tmp_path / "ssd"), "capacity": "2MiB", "compression": "none"},
        "spill": {"write_through": False}})
    gen = torch.Generator().manual_seed(0)
    with TieredKVCache(cfg) as cache:
        for i in range(300):
            a = cache.allocate(f"r{i}", list(range(i * 1000, i * 1000 + 16 * 48 + 1)))
            cache.kv_pool[a.block_ids] = torch.randint(0, 256, (len(a.block_ids), nbytes),
                                                       dtype=torch.uint8, generator=gen)
            cache.commit(f"r{i}")
            cache.free(f"r{i}")
        assert cache.flush()
        ssd = cache.stats()["ssd"]
        assert ssd["blocks_written"] > 2 * 256 and ssd["evictions"] == 0, ssd


def test_metrics_host_keeps_the_endpoint_on_loopback(tmp_path):
    """metrics.host: 127.0.0.1 listens on this machine only (the default, 0.0.0.0, on
    every interface)."""
    with TieredKVCache(config(tmp_path, metrics={"port": 0, "host": "127.0.0.1"})) as cache:
        assert cache._metrics_server.server_address[0] == "127.0.0.1"
    with TieredKVCache(config(tmp_path, metrics={"port": 0})) as cache:
        assert cache._metrics_server.server_address[0] == "0.0.0.0"


def test_a_metrics_port_in_use_is_a_config_error_and_leaves_nothing_open(tmp_path):
    """The SSD tier opens before the metrics server starts: a port in use must close it
    again, or a retry in this process finds its directory taken."""
    import socket

    from kvstrata.errors import ConfigError

    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"metrics.port: cannot serve metrics on 0.0.0.0:{port}"):
            TieredKVCache(config(tmp_path, metrics={"port": port}))
    with TieredKVCache(config(tmp_path)) as cache:
        Driver(cache).run("a", list(range(12)))
        assert cache.ssd is not None and cache.ssd.stats()["available"]


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (the transfer engine's copy stream)")]),
])
def test_caller_pool_every_hit_is_byte_exact(tmp_path, device):
    """A pool the caller passes (on CUDA: the transfer engine's pinned staging, copy
    stream, events, Allocation.wait()); the CPU case runs the same code everywhere."""
    pool = torch.zeros((16, NBYTES), dtype=torch.uint8, device=device)
    with TieredKVCache(config(tmp_path, gpu=None), kv_pool=pool) as cache:
        assert cache.kv_pool is pool
        driver = Driver(cache)
        for rid, toks in chat(users=10, turns=5):
            driver.run(rid, toks)
            cache.free(rid)
    assert all(driver.checked.values()), driver.checked


class LayerDriver(Driver):
    """A block is its page in every one of the caller's per-layer caches, in order."""

    def get(self, block: int) -> bytes:
        return b"".join(bytes(c[block].reshape(-1).view(torch.uint8).cpu().numpy()) for c in self.cache.kv_pool)

    def put(self, block: int, data: bytes) -> None:
        at = 0
        for c in self.cache.kv_pool:
            n = c[block].numel() * c.element_size()
            page = torch.frombuffer(bytearray(data[at:at + n]), dtype=torch.uint8).to(c.device)
            c[block].reshape(-1).view(torch.uint8).copy_(page)
            at += n


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (the gather/scatter kernels)")]),
])
def test_per_layer_caches_every_hit_is_byte_exact(tmp_path, device):
    """An engine's own per-layer caches as the pool (dtypes and shapes differ, FP8
    included): every block served from any tier has every page's bytes."""
    caches = [torch.zeros((16, 2, 8, 4), dtype=torch.float16, device=device),   # 128 bytes a page
              torch.zeros((16, 64), dtype=torch.float8_e4m3fn, device=device),  # 64
              torch.zeros((16, 4, 4), dtype=torch.float32, device=device)]      # 64: NBYTES in all
    with TieredKVCache(config(tmp_path, gpu=None), kv_pool=caches) as cache:
        assert cache.block_nbytes == NBYTES and cache.manager.num_blocks == 16
        driver = LayerDriver(cache)
        for rid, toks in chat(users=10, turns=5):
            driver.run(rid, toks)
            cache.free(rid)
    assert all(driver.checked.values()), driver.checked


@pytest.mark.parametrize("caches, message", [
    ([], "a non-empty list"),
    ([torch.zeros((4, 8)), torch.zeros((5, 8))], r"kv_pool\[1\]: 5 blocks on cpu, but kv_pool\[0\] has 4"),
    ([torch.zeros((8, 4)).t()], r"kv_pool\[0\]: expected a contiguous tensor"),
])
def test_per_layer_caches_that_do_not_form_a_pool_are_refused(tmp_path, caches, message):
    with pytest.raises(ValueError, match=message):
        TieredKVCache(config(tmp_path, gpu=None), kv_pool=caches)


def test_close_persists_the_whole_hot_set_through_a_small_ssd_queue(tmp_path):
    """The shutdown store waits for a full SSD write queue instead of dropping blocks."""
    toks = list(range(60 * BS + 1))  # 60 full blocks, all GPU-resident at close
    cfg = config(tmp_path, gpu=64, cpu=1, ssd="16MiB", admission="on_evict")
    cfg = dataclasses.replace(cfg, ssd=dataclasses.replace(cfg.ssd, queue_capacity=2 * NBYTES))
    with TieredKVCache(cfg) as cache:
        Driver(cache).run("a", toks)
        cache.free("a")
    with TieredKVCache(cfg) as fresh:
        a = Driver(fresh).run("again", toks)  # byte-exact
        assert a.hit_blocks == {"gpu": 0, "cpu": 0, "ssd": 60}


def test_load_staging_rows_are_pinned_only_for_a_cuda_pool() -> None:
    from kvstrata.dataplane.device_rows import PoolRows
    from kvstrata.dataplane.transfer import TransferEngine

    rows = PoolRows(TransferEngine(torch.zeros((4, NBYTES), dtype=torch.uint8))).staging(3)
    assert rows.shape == (3, NBYTES) and rows.dtype == np.uint8
    assert not torch.from_numpy(rows).is_pinned()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned host memory)")
def test_load_staging_rows_are_pinned_for_a_cuda_pool() -> None:
    from kvstrata.dataplane.device_rows import PoolRows
    from kvstrata.dataplane.transfer import TransferEngine

    rows = PoolRows(TransferEngine(torch.zeros((4, NBYTES), dtype=torch.uint8, device="cuda"))).staging(3)
    assert torch.from_numpy(rows).is_pinned()  # write_rows copies it up without a second host copy


@pytest.mark.parametrize("writer", ["caught_up", "behind"])
def test_close_leaves_the_hot_set_most_recent_on_disk(tmp_path, monkeypatch, writer):
    """Blocks stored when computed and hit on the GPU ever since (a shared system prompt)
    are the oldest records on disk until close() refreshes them: a new cache's SSD tier
    then lists them as most recently used, so new traffic evicts colder records first.
    Whether the SSD writer has written the users' blocks when close() touches the hot set
    must not matter; both timings are fixed here: every put written before close()
    (``caught_up``), or the system prompt written and the users' puts still queued,
    taken by the writer in one turn with close()'s touches (``behind``)."""
    from kvstrata.tiers.ssd import writer as ssd_writer

    if writer == "behind":  # a writer woken by a put waits for a flush (blocks << 1 MiB)
        monkeypatch.setattr(ssd_writer, "LINGER_S", 60.0)
    system = list(range(1000, 1032))  # 8 full blocks, stored at once (on_compute)
    with TieredKVCache(config(tmp_path, gpu=24, cpu=1)) as cache:
        d = Driver(cache)
        for u in range(12):  # each user's own blocks are stored after the system prompt's
            d.run(f"u{u}", system + [50_000 + 100 * u + i for i in range(9)])
            cache.free(f"u{u}")
            if u == 0 and writer == "behind":
                assert cache.flush()  # the system prompt is on disk; later puts stay queued
        d.run("last", system + [1])
        cache.free("last")
        if writer == "caught_up":
            assert cache.flush()
        system_keys = cache.hasher.hash_blocks(system)
    with TieredKVCache(config(tmp_path, gpu=24, cpu=1)) as fresh:
        on_disk = list(fresh.ssd.keys())
        assert set(system_keys) <= set(on_disk) and on_disk[-8:] == system_keys[::-1]  # the head is evicted last


@pytest.mark.parametrize("eviction", ["s3fifo", "arc"])
def test_a_tier_reopened_under_another_eviction_keeps_every_block(tmp_path, eviction):
    """A real LMDB written under LRU, reopened with another order: nothing is dropped, and the
    blocks are served from it byte for byte."""
    toks = list(range(41))
    with TieredKVCache(config(tmp_path)) as cache:
        d = Driver(cache)
        d.run("a", toks)
        cache.free("a")
        d.push_out(6, 30, 90_000)
        cache.flush()
        held = len(cache.policy.store)
    base = config(tmp_path)
    other = dataclasses.replace(base, cpu=dataclasses.replace(base.cpu, eviction=eviction),
                                ssd=dataclasses.replace(base.ssd, eviction=eviction))
    with TieredKVCache(other) as fresh:
        assert len(fresh.policy.store) == held > 10
        a = Driver(fresh).run("again", toks)
        assert a.hit_blocks == {"gpu": 0, "cpu": 0, "ssd": 10}
        fresh.policy.check()
