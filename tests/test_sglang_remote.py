"""The SGLang backend's shared remote tier, against a real Valkey server (tests/valkey_server.py).

A second SGLang process (a real subprocess: its own SGLang host pool and SSD tier, the
backend created by SGLang's factory) writes pages with ``batch_set_v1``; this process, with
an SSD tier of its own that holds none of them, finds them with ``batch_exists`` (an SSD
miss, a remote hit) and reads them byte-exact with ``batch_get_v1`` into its own host pool,
in SGLang's batches of 128 pages. A server that dies costs only misses: no call raises, and
none waits longer than the remote tier's timeouts.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from sglang_env import create_backend, fill, host_pool, page_bytes  # noqa: E402
from valkey_server import ValkeyServer, secret_file  # noqa: E402

pytestmark = pytest.mark.slow  # a second process imports SGLang (seconds)

BATCH = 128
PAGES = 140

WRITER = """
import json, sys
sys.path.insert(0, {here!r})
from sglang_env import create_backend, fill, host_pool, page_bytes
extra, keys, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
host = host_pool("page_first", device_tokens=600, ratio=2.0)
backend = create_backend(extra, host)
src = host.alloc(len(keys) * host.page_size)
fill(host, src, seed=21)
taken = []
for lo in range(0, len(keys), 128):
    part = src[lo * host.page_size:min(len(keys), lo + 128) * host.page_size]
    taken += backend.batch_set_v1(keys[lo:lo + 128], part)
assert backend.flush()
stats = backend.get_stats().kvstrata
backend.close()
with open(out, "wb") as f:
    f.write(b"".join(page_bytes(host, src)))
print(json.dumps({{"taken": sum(taken), "remote": stats.get("remote", {{}}).get("puts", None)}}))
"""


def keys_of(n: int, seed: str = "r") -> list[str]:
    return [hashlib.sha256(f"{seed}/{i}".encode()).hexdigest() for i in range(n)]


@pytest.fixture
def server():
    with ValkeyServer() as s:
        yield s


def extra(tmp: Path, name: str, url: str, **more) -> dict:
    return {"ssd.path": str(tmp / name), "ssd.capacity": "64MiB", "model.id": "test-model",
            "remote.url": url, "remote.secret_file": secret_file(tmp), **more}


def write_in_another_process(tmp: Path, server: ValkeyServer, keys: list[str]) -> list[bytes]:
    """The pages a second SGLang process stored under ``keys`` (through its own SSD tier and
    the shared server), as that process's host pool held them."""
    out = tmp / "written.bin"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", WRITER.format(here=str(HERE)),
                           json.dumps(extra(tmp, "writer-ssd", server.url)), json.dumps(keys), str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["taken"] == len(keys)
    data = out.read_bytes()
    size = len(data) // len(keys)
    return [data[i * size:(i + 1) * size] for i in range(len(keys))]


def test_pages_a_second_process_wrote_are_found_and_read_byte_exact_through_the_remote_tier(tmp_path, server) -> None:
    keys = keys_of(PAGES)
    written = write_in_another_process(tmp_path, server, keys)
    host = host_pool("page_first", device_tokens=600, ratio=2.0)
    backend = create_backend(extra(tmp_path, "reader-ssd", server.url), host)
    try:
        assert backend.store.executor.persistent is not None and not list(backend.store.executor.persistent.keys())
        assert backend.batch_exists(keys[:BATCH]) == BATCH  # an SSD miss, a remote hit
        assert backend.batch_exists(keys[BATCH:]) == PAGES - BATCH
        got: list[bytes] = []
        for lo in range(0, PAGES, BATCH):  # the controller's batches: 128, then 12
            part = keys[lo:lo + BATCH]
            dst = host.alloc(len(part) * host.page_size)
            assert backend.batch_get_v1(part, dst) == [True] * len(part)
            got += page_bytes(host, dst)
        assert got == written
        stats = backend.get_stats().kvstrata
        assert stats["hits"]["remote"]["blocks"] == PAGES and stats["hits"]["ssd"]["blocks"] == 0
    finally:
        backend.close()


def test_batch_exists_runs_across_tiers_the_ssd_prefix_then_the_remote_tier(tmp_path, server) -> None:
    keys = keys_of(40)
    write_in_another_process(tmp_path, server, keys[10:40])  # the remote tier holds pages 10..39
    host = host_pool("page_first", device_tokens=600, ratio=2.0)
    backend = create_backend(extra(tmp_path, "reader-ssd", server.url), host)
    try:
        src = host.alloc(10 * host.page_size)
        fill(host, src, seed=22)
        assert all(backend.batch_set_v1(keys[:10], src))  # this process's SSD tier: pages 0..9
        assert backend.batch_exists(keys) == 40  # 10 from the SSD tier, 30 from the remote one
        assert backend.batch_exists(keys_of(3, "none") + keys) == 0
        gap = keys[:10] + keys_of(1, "gap") + keys[10:]
        assert backend.batch_exists(gap) == 10  # a page neither holds ends the run
        dst = host.alloc(40 * host.page_size)
        assert backend.batch_get_v1(keys, dst) == [True] * 40
        assert page_bytes(host, dst)[:10] == page_bytes(host, src)
    finally:
        backend.close()


def test_a_dead_remote_server_costs_only_misses_and_never_raises(tmp_path, server) -> None:
    keys = keys_of(PAGES)
    write_in_another_process(tmp_path, server, keys)
    host = host_pool("page_first", device_tokens=600, ratio=2.0)
    backend = create_backend(extra(tmp_path, "reader-ssd", server.url, **{"remote.timeout": 0.2}), host)
    try:
        assert backend.batch_exists(keys[:BATCH]) == BATCH
        server.kill()  # SIGKILL: the server vanishes
        started = time.monotonic()
        dst = host.alloc(BATCH * host.page_size)
        assert backend.batch_exists(keys[:BATCH]) == 0
        assert backend.batch_get_v1(keys[:BATCH], dst) == [False] * BATCH
        assert backend.batch_get(keys[:2], [host.get_dummy_flat_data_page() for _ in range(2)]) == [None, None]
        own = keys_of(BATCH, "own")
        src = host.alloc(BATCH * host.page_size)
        fill(host, src, seed=23)
        assert backend.batch_set_v1(own, src) == [True] * BATCH  # the SSD tier takes them
        assert backend.batch_exists(own) == BATCH
        assert backend.batch_get_v1(own, dst) == [True] * BATCH and page_bytes(host, dst) == page_bytes(host, src)
        assert time.monotonic() - started < 20  # timeouts, not hangs
        stats = backend.get_stats().kvstrata
        assert stats["errors"] == 0  # nothing raised inside the backend either
    finally:
        backend.close()
