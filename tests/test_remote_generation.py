"""A reset reaches the remote tier: after ``TieredKVCache.reset()`` (an in-place weight update)
nothing written to the shared server before it is served, by this cache or by another one
that reset too; one that has not reset keeps its generation. Real Valkey servers
(tests/valkey_server.py); a server that is "down" is a real one stopped with SIGSTOP (it keeps
its keys, and answers nothing), then resumed with SIGCONT."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from kvstrata import TieredKVCache

sys.path.insert(0, str(Path(__file__).parent))
from test_tiered_remote import BS, NB, compute, config  # noqa: E402
from valkey_server import ValkeyServer, secret_file  # noqa: E402

TOKENS = list(range(40))  # 9 blocks of BS tokens are looked up (never the last token)


@pytest.fixture
def server():
    with ValkeyServer() as s:
        yield s


@contextmanager
def stopped(server: ValkeyServer) -> Iterator[None]:
    """The server process stopped (SIGSTOP): connections are accepted by the kernel, nothing answers."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


def hits(cache: TieredKVCache, req: str, tokens: list[int]) -> tuple[dict[str, int], torch.Tensor]:
    alloc = cache.allocate(req, tokens)
    alloc.wait()
    rows = cache.kv_pool[alloc.block_ids].clone()
    cache.free(req)
    return dict(alloc.hit_blocks), rows


def value_keys(server: ValkeyServer) -> list[bytes]:
    return [k for k in server.client().keys(b"kvstrata:*") if not k.endswith(b":generation")]


def test_a_reset_serves_nothing_written_before_it(server: ValkeyServer, tmp_path: Path) -> None:
    a = TieredKVCache(config(tmp_path, "a", server.url))
    b = TieredKVCache(config(tmp_path, "b", server.url))
    try:
        old = compute(a, "r", TOKENS)
        a.flush()
        assert len(value_keys(server)) == 10  # every full block of the prompt
        a.reset()
        got, rows = hits(a, "again", TOKENS)
        assert got == {"gpu": 0, "cpu": 0, "ssd": 0, "remote": 0}  # nowhere: GPU, DRAM, SSD and the server forgot
        assert a.stats()["remote"]["hits"] == 0 and a.stats()["remote"]["probe_hits"] == 0
        new = compute(a, "r2", TOKENS, seed=1)  # "the new weights" give other bytes
        a.flush()
        assert len(value_keys(server)) == 20  # the old values are still on the server ...
        got, rows = hits(b, "b", TOKENS)  # ... and b, not reset, still serves them: its own weights' KV
        assert got["remote"] == 9 and torch.equal(rows[:9], old[:9])
        c = TieredKVCache(config(tmp_path, "c", server.url))  # a replica started after the update joins a's generation
        got, rows = hits(c, "c", TOKENS)
        assert got["remote"] == 9 and torch.equal(rows[:9], new[:9])
        c.close()
        b.reset()
        got, rows = hits(b, "b2", TOKENS)  # b reset too: neither the old values nor a's new ones (another generation)
        assert got == {"gpu": 0, "cpu": 0, "ssd": 0, "remote": 0}
    finally:
        a.close(), b.close()


def test_a_reset_refuses_while_requests_hold_blocks(server: ValkeyServer, tmp_path: Path) -> None:
    a = TieredKVCache(config(tmp_path, "a", server.url))
    try:
        a.allocate("held", TOKENS)
        with pytest.raises(ValueError, match=r"^reset: 1 requests are allocated \(held"):
            a.reset()
        a.free("held")
        a.reset()
    finally:
        a.close()


def test_a_reset_while_the_server_is_down_never_serves_old_values_later(server: ValkeyServer,
                                                                        tmp_path: Path) -> None:
    a = TieredKVCache(config(tmp_path, "a", server.url))
    other = list(range(500, 540))
    try:
        compute(a, "r", TOKENS)
        compute(a, "s", other)
        a.flush()
        a.reset()  # the GPU pool and local tiers: a prompt it has seen must not hit locally
        with stopped(server):
            began = time.monotonic()
            a.reset()  # the new generation cannot be made now: reads miss, writes drop until it is
            assert time.monotonic() - began < 2.0
            got, _ = hits(a, "down", TOKENS)
            assert got["remote"] == 0
        deadline = time.monotonic() + 15
        while a.remote.generation_token is None and time.monotonic() < deadline:
            a.remote.probe([b"x" * 32])  # the breaker lets a round trip through again: the bump is made
            time.sleep(0.1)
        assert a.remote.generation_token is not None
        assert len(value_keys(server)) == 20  # the old values are on the server still
        got, _ = hits(a, "up", other)
        assert got == {"gpu": 0, "cpu": 0, "ssd": 0, "remote": 0}
    finally:
        a.close()


def test_writes_queued_before_a_reset_land_in_the_old_generation(server: ValkeyServer, tmp_path: Path) -> None:
    """The remote tier on its own: a put queued before the reset is sent under the key it was
    queued with; the new generation never finds it."""
    from kvstrata.config.schema import KVStrataConfig
    from kvstrata.tiers.remote import RemoteTier

    cfg = KVStrataConfig.from_dict({"remote": {"url": server.url, "secret_file": secret_file(tmp_path)}})
    tier = RemoteTier.from_config(cfg.remote, ["fp"], NB)
    try:
        assert tier.probe([b"k" * 32]) == 0 and tier.generation_token is not None  # joined
        before = tier.prefix
        row = np.full(NB, 7, dtype=np.uint8)
        for i in range(64):
            assert tier.put(bytes([i]) * 32, row)
        tier.reset()
        assert tier.put(b"z" * 32, row) is False  # no generation yet: nothing is written anywhere
        assert tier.probe([bytes([i]) * 32 for i in range(64)]) == 0  # the bump is made, nothing found there
        assert tier.flush(10)
        assert tier.prefix != before
        client = server.client()
        assert all(client.exists(before + bytes([i]) * 32) for i in range(64))  # under the old generation
        rows = np.zeros((64, NB), dtype=np.uint8)
        assert tier.get_into([bytes([i]) * 32 for i in range(64)], rows) == 0
        assert client.get(tier.base + b"generation") == tier.generation_token
    finally:
        tier.close()


def test_the_generation_record_is_joined_made_once_and_replaced_when_it_is_not_one(
        server: ValkeyServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from kvstrata.config.schema import KVStrataConfig
    from kvstrata.tiers.remote import RemoteTier

    cfg = KVStrataConfig.from_dict({"remote": {"url": server.url, "secret_file": secret_file(tmp_path)}})

    def joined() -> bytes:
        tier = RemoteTier.from_config(cfg.remote, ["fp"], NB, writer=False)
        try:
            tier.probe([])
            assert tier.generation_token is not None
            return tier.generation_token
        finally:
            tier.close()

    first = joined()
    assert joined() == first  # replicas that start join the same generation
    client = server.client()
    record = [k for k in client.keys(b"*") if k.endswith(b":generation")]
    assert record and client.get(record[0]) == first
    client.delete(record[0])  # evicted: a new one, never an old one again
    again = joined()
    assert again != first
    client.delete(record[0])
    client.rpush(record[0], b"x")  # another type under the record
    with caplog.at_level(logging.WARNING, logger="kvstrata.tiers.remote.tier"):
        replaced = joined()
    assert replaced not in (first, again) and client.get(record[0]) == replaced
    assert "does not hold a generation" in caplog.text
    client.set(record[0], b"../" * 30)
    assert joined() != replaced and len(client.get(record[0])) == 16


def test_a_join_answered_after_a_reset_is_dropped(server: ValkeyServer) -> None:
    """The reset comes between the join's round trip and its answer (the interleaving is forced by
    a client that resets during its GET; the server is real)."""
    import redis

    from kvstrata.tiers.remote.generation import Generation

    gen = Generation(b"kvstrata:test:generation")
    real = redis.Redis(port=server.port)

    class ResettingClient:
        def set(self, *args, **kw):
            return real.set(*args, **kw)

        def get(self, key):
            value = real.get(key)
            gen.reset()  # the reset lands while the answer is on its way
            return value

    assert gen.settle(ResettingClient(), lambda *a: None) is None
    assert gen.pending == "bump" and gen.token is None  # the old generation was not adopted
    joined = real.get(b"kvstrata:test:generation")
    token = gen.settle(real, lambda *a: None)  # the bump: a generation of its own
    assert token not in (None, joined) and real.get(b"kvstrata:test:generation") == token and gen.pending is None


def test_a_reset_forgets_what_second_hit_admission_saw() -> None:
    """A block seen once before a reset is seen for the first time with the new weights: it is
    not taken by the remote (or SSD) tier on its first offer after it."""
    from test_admission import K, policy, store

    from kvstrata.policy.tiers import REMOTE, SSD

    p = policy(cpu=8, ssd=8, remote=True)
    store(p, K[:2])  # seen once: neither tier takes them
    assert p.counts.counts["rejected"][REMOTE] == 2
    p.clear()
    plan = p.prepare_store([0, 1], K[:2], "computed")
    assert not plan.goes_to(REMOTE) and not plan.goes_to(SSD)  # the first sighting with these weights
    assert p.counts.counts["rejected"][REMOTE] == 4 and p.counts.counts["rejected"][SSD] == 4


def test_the_generation_record_is_kept_recently_used(server: ValkeyServer, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``allkeys-lru`` evicts what nobody reads: the record, read only when a replica starts or
    resets, is read again with the lookups every ``TOUCH_EVERY`` seconds."""
    import kvstrata.tiers.remote.generation as generation

    monkeypatch.setattr(generation, "TOUCH_EVERY", 1.0)
    a = TieredKVCache(config(tmp_path, "a", server.url))
    try:
        client = server.client()
        (record,) = [k for k in client.keys(b"*") if k.endswith(b":generation")]
        time.sleep(2.2)
        assert client.object("idletime", record) >= 2
        hits(a, "r", TOKENS)  # a lookup: the record is read again
        assert client.object("idletime", record) == 0
        assert client.get(record) == a.remote.generation_token
    finally:
        a.close()
