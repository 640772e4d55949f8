"""The remote tier against a real Valkey server (tests/valkey_server.py; never skipped).

Every test starts its own server on a free loopback port: no persistence,
``maxmemory`` bounded, ``allkeys-lru``."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvstrata.config.remote import RemoteConfig
from kvstrata.tiers.remote import RemoteTier, key_prefix
from kvstrata.system.breaker import Breaker
from kvstrata.tiers.remote.value import encode
from kvstrata.tiers.ssd.record import Codec

sys.path.insert(0, str(Path(__file__).parent))
from valkey_server import ValkeyServer, free_port  # noqa: E402

NB = 64 * 1024
PREFIX = key_prefix("fingerprint-a")


def blocks(n: int, seed: int = 0, nbytes: int = NB) -> tuple[list[bytes], np.ndarray]:
    rng = np.random.default_rng(seed)
    # KV-like fp16 values (compressible high bytes), so the codec path is exercised
    rows = rng.standard_normal((n, nbytes // 2)).astype(np.float16).view(np.uint8).reshape(n, nbytes)
    keys = [rng.bytes(32) for _ in range(n)]
    return keys, rows


CONFIG_FIELDS = {f.name for f in dataclasses.fields(RemoteConfig)}


def tier(server: ValkeyServer, prefix: bytes = PREFIX, **kw) -> RemoteTier:
    """A tier on ``server``: ``kw`` names fields of ``remote.*`` (``timeout`` and
    ``connect_timeout`` 0.3 s unless given) or RemoteTier's own keywords (``breaker``, ...)."""
    fields = {"timeout": 0.3, "connect_timeout": 0.3} | {k: v for k, v in kw.items() if k in CONFIG_FIELDS}
    own = {k: v for k, v in kw.items() if k not in CONFIG_FIELDS}
    return RemoteTier(RemoteConfig(url=server.url, **fields), prefix, NB, **own)


def fill(t: RemoteTier, keys, rows) -> None:
    for k, r in zip(keys, rows):
        assert t.put(k, r)
    assert t.flush(10)


@pytest.fixture
def server():
    with ValkeyServer() as s:
        yield s


def test_blocks_round_trip_exactly_and_compressed(server) -> None:
    keys, rows = blocks(40)
    with_zstd = tier(server, compression="zstd")
    fill(with_zstd, keys, rows)
    out = np.zeros_like(rows)
    assert with_zstd.probe(keys) == 40
    assert with_zstd.get_into(keys, out) == 40
    assert np.array_equal(out, rows)
    st = with_zstd.stats()
    assert st["written"] == 40 and st["hits"] == 40
    assert st["bytes_written"] < rows.nbytes * 0.95  # the byte-plane codec saved space
    again = tier(server)
    fill(again, keys[:5], rows[:5])  # SET NX: already there, not rewritten
    assert again.stats()["present"] == 5 and again.stats()["written"] == 0
    with_zstd.close(), again.close()


def test_a_prefix_stops_at_the_first_missing_block(server) -> None:
    keys, rows = blocks(10)
    t = tier(server)
    fill(t, keys[:4] + keys[5:], np.concatenate([rows[:4], rows[5:]]))
    out = np.zeros_like(rows)
    assert t.probe(keys) == 4
    assert t.get_into(keys, out) == 4
    assert np.array_equal(out[:4], rows[:4])
    # each key on its own (KV-cache groups need some keys of each position only)
    assert t.probe_each(keys) == [True] * 4 + [False] + [True] * 5
    assert t.probe_async(keys[3:6], each=True).result(timeout=10) == [True, False, True]
    t.close()


def test_garbage_truncated_and_misplaced_values_are_misses(server) -> None:
    keys, rows = blocks(5)
    t = tier(server)
    fill(t, keys, rows)
    raw = server.client()
    codec = Codec()
    good = raw.get(t.key(keys[0]))
    raw.set(t.key(keys[0]), b"another tool's value")                  # not ours at all
    raw.set(t.key(keys[1]), good[:-100])                                # truncated
    raw.set(t.key(keys[2]), good)                                       # another key's value
    raw.set(t.key(keys[3]), encode(t.key(keys[3]), rows[3][:NB // 2].tobytes(), codec))  # another block size
    # the writer thread is held off (its condition is held here) until flush waits: flush must
    # wait for the deletes the reads queued, not only for puts
    with t._writes._cond:
        for i in range(4):
            out = np.zeros((1, NB), np.uint8)
            assert t.get_into([keys[i]], out) == 0, i
        out = np.zeros((1, NB), np.uint8)
        assert t.get_into([keys[4]], out) == 1 and np.array_equal(out[0], rows[4])
        assert t.stats()["corrupt"] == 4
        assert t.flush(5)
        assert all(raw.get(t.key(k)) is None for k in keys[:4])  # deleted, so a good value can be stored again
    t.close()


def test_namespaces_are_isolated(server) -> None:
    keys, rows = blocks(3)
    a, b = tier(server), tier(server, key_prefix("fingerprint-b"))
    fill(a, keys, rows)
    out = np.zeros_like(rows)
    assert b.probe(keys) == 0 and b.get_into(keys, out) == 0
    assert all(k.startswith(b"kvstrata:") for k in server.client().keys(b"*"))
    a.close(), b.close()


WRITER = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
from test_remote_tier import blocks, tier, fill
from valkey_server import ValkeyServer
class S: url = {url!r}
keys, rows = blocks(20, seed=7)
t = tier(S)
fill(t, keys, rows)
t.close()
"""


def test_two_processes_share_blocks(server) -> None:
    code = WRITER.format(tests=str(Path(__file__).parent), url=server.url)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    keys, rows = blocks(20, seed=7)
    t = tier(server)
    out = np.zeros_like(rows)
    assert t.get_into(keys, out) == 20
    assert np.array_equal(out, rows)
    t.close()


def test_a_killed_server_costs_misses_within_the_deadline_and_a_restart_closes_the_breaker(server) -> None:
    keys, rows = blocks(8)
    t = tier(server, breaker=Breaker(failures=2, cooldown=0.3))
    fill(t, keys, rows)
    server.kill()
    out = np.zeros_like(rows)
    for _ in range(4):
        start = time.monotonic()
        assert t.get_into(keys, out) == 0
        assert t.probe(keys) == 0
        assert time.monotonic() - start < 2 * (t.timeout + 0.1)  # two calls, each within its deadline
    assert t.breaker.state in ("open", "half-open") and t.stats()["breaker_opened"] == 1
    start = time.monotonic()
    assert not t.put(keys[0], rows[0]) or t.flush(5)  # refused at once while open, or dropped by the writer
    assert time.monotonic() - start < 5
    server.start()  # same port, empty
    deadline = time.monotonic() + 10
    while t.breaker.state != "closed" and time.monotonic() < deadline:
        t.probe(keys[:1])
        time.sleep(0.1)
    assert t.breaker.state == "closed"
    assert t.get_into(keys, out) == 0  # restarted empty: misses, never stale bytes
    fill(t, keys, rows)
    assert t.get_into(keys, out) == 8 and np.array_equal(out, rows)
    t.close()


def test_a_paused_server_is_a_timeout_not_a_hang(server) -> None:
    keys, rows = blocks(4)
    t = tier(server, timeout=0.2)
    try:  # closed whatever fails: a tier left open keeps logging into later tests
        fill(t, keys, rows)
        server.client().execute_command("CLIENT", "PAUSE", "1500", "ALL")
        out = np.zeros_like(rows)
        start = time.monotonic()
        assert t.get_into(keys, out) == 0
        assert time.monotonic() - start < 0.6
        assert t.stats()["timeouts"] == 1
        assert t.get_into(keys, out) == 0  # the reader is still stuck: refused at once
        time.sleep(1.6)
        deadline = time.monotonic() + 5
        while t.get_into(keys, out) != 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert np.array_equal(out, rows)
    finally:
        t.close()


def test_past_maxmemory_the_server_evicts_and_the_prefix_stops_at_the_first_evicted_block() -> None:
    with ValkeyServer(maxmemory="4mb") as s:
        keys, rows = blocks(200)  # ~13 MiB of values into 4 MiB
        t = RemoteTier(RemoteConfig(url=s.url, timeout=1.0, batch_bytes=256 * 1024), PREFIX, NB)
        fill(t, keys, rows)
        info = s.client().info()
        assert info["evicted_keys"] > 0
        out = np.zeros_like(rows)
        n = t.get_into(keys, out)
        held = [s.client().exists(t.key(k)) for k in keys]
        assert n == held.index(0) if 0 in held else n == len(keys)
        assert np.array_equal(out[:n], rows[:n])
        later = [i for i, h in enumerate(held) if h]  # the recent ones survive, byte for byte
        assert later and all(t.get_into([keys[i]], out[i:i + 1]) == 1 for i in later)
        assert np.array_equal(out[later], rows[later])
        t.close()


def test_a_full_queue_drops_and_counts() -> None:
    with ValkeyServer() as s:
        s.client().execute_command("CLIENT", "PAUSE", "1000", "WRITE")
        keys, rows = blocks(8)
        t = RemoteTier(RemoteConfig(url=s.url, timeout=2.0, queue_capacity=3 * NB, batch_bytes=64 * 1024), PREFIX, NB)
        ok = [t.put(k, r) for k, r in zip(keys, rows)]
        assert not all(ok) and t.stats()["dropped_full"] == ok.count(False)
        t.close()


def test_no_server_and_a_wrong_protocol_server_are_misses_not_errors(caplog) -> None:
    keys, rows = blocks(2)
    nobody = RemoteTier(RemoteConfig(url=f"redis://127.0.0.1:{free_port()}/0", timeout=0.3, connect_timeout=0.3),
                        PREFIX, NB)
    out = np.zeros_like(rows)
    assert nobody.get_into(keys, out) == 0 and nobody.probe(keys) == 0
    nobody.put(keys[0], rows[0])
    nobody.close(timeout=2)
    from fake_server import answering

    with answering(b"HTTP/1.1 400 Bad Request\r\n\r\n") as port:  # speaks HTTP
        http = RemoteTier(RemoteConfig(url=f"redis://127.0.0.1:{port}/0", timeout=0.3), PREFIX, NB)
        start = time.monotonic()
        assert http.get_into(keys, out) == 0 and http.probe(keys) == 0
        assert time.monotonic() - start < 1.0
        assert http.stats()["errors"] + http.stats()["timeouts"] >= 1
        http.close(timeout=2)


def test_a_server_without_maxmemory_is_warned_about(caplog) -> None:
    with ValkeyServer(maxmemory="0") as s, caplog.at_level(logging.WARNING, logger="kvstrata.tiers.remote.tier"):
        t = RemoteTier(RemoteConfig(url=s.url), PREFIX, NB)
        keys, rows = blocks(1)
        fill(t, keys, rows)
        t.close()
    assert any("no maxmemory" in r.getMessage() for r in caplog.records)


def test_breaker_opens_after_repeated_failures_and_probes_its_way_back() -> None:
    now = [0.0]
    b = Breaker(failures=3, cooldown=1.0, max_cooldown=4.0, clock=lambda: now[0])
    assert not b.failure() and not b.failure() and b.allow()
    assert b.failure() and b.state == "open" and not b.allow()
    now[0] = 1.0
    assert b.allow() and not b.allow()  # one probe at a time
    b.failure()                          # a failed probe doubles the cooldown
    now[0] = 2.5
    assert not b.allow()
    now[0] = 3.0
    assert b.allow() and b.success() and b.state == "closed" and b.allow()
