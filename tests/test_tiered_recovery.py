"""TieredKVCache over an SSD tier that recovers in the background after a SIGKILL.

A real process fills the tier through the library and is killed with SIGKILL; the
next cache opens the tier while its walk is held back (the walk itself is real), so
that the constructor reliably sees a tier that lists nothing yet. Once the recovery
is over the library holds what it verified, through the same seeding the vLLM
scheduler uses."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvstrata import KVStrataConfig, TieredKVCache
from kvstrata.tiers.ssd import SSDTier

from recovery_gate import hold_walks

ROOT = str(Path(__file__).resolve().parents[1])
BS, NBYTES, PROMPTS, BLOCKS = 4, 256, 40, 6


def config(path: Path) -> KVStrataConfig:
    return KVStrataConfig.from_dict({
        "block_size": BS, "model": {"block_nbytes": NBYTES}, "gpu": {"num_blocks": 16},
        "cpu": {"capacity": 8 * NBYTES}, "ssd": {"path": str(path), "capacity": "8MiB"}})


def prompt(i: int) -> list[int]:
    return [i * 1000 + j for j in range(BLOCKS * BS + 1)]


def payload(i: int, pos: int) -> bytes:
    return bytes([(i * 7 + pos) % 251]) * NBYTES


_WRITER = """
import sys, time, torch
sys.path[:0] = [sys.argv[2], sys.argv[2] + "/tests"]
from tests.test_tiered_recovery import config, prompt, payload, PROMPTS, BLOCKS
from kvstrata import TieredKVCache
from pathlib import Path
cache = TieredKVCache(config(Path(sys.argv[1])))
for i in range(PROMPTS):
    a = cache.allocate(f"p{i}", prompt(i))
    for pos, row in enumerate(a.block_ids[:BLOCKS]):
        cache.kv_pool[row] = torch.frombuffer(bytearray(payload(i, pos)), dtype=torch.uint8)
    cache.commit(f"p{i}")
    cache.free(f"p{i}")
assert cache.flush()
print("flushed", flush=True)
time.sleep(600)
"""


def kill_after_filling(path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), ROOT], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "flushed"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The recovery's walk waits until the test sets this event; every tier recovers in the
    background (as a production index over ``recover_inline_bytes`` does)."""
    opened = hold_walks(monkeypatch)
    monkeypatch.setitem(SSDTier.__init__.__kwdefaults__, "recover_inline_bytes", 0)
    return opened


def ssd_hits(cache: TieredKVCache, ids: range) -> int:
    """SSD hits over the prompts ``ids``, each loaded block checked byte for byte."""
    hits = 0
    for i in ids:
        a = cache.allocate(f"again{i}", prompt(i))
        a.wait()
        for pos in range(a.num_cached_tokens // BS):
            assert bytes(cache.kv_pool[a.block_ids[pos]].numpy()) == payload(i, pos)
        hits += a.hit_blocks["ssd"]
        cache.free(f"again{i}")
    return hits


def test_the_library_serves_what_a_background_recovery_verified(tmp_path, gate):
    kill_after_filling(tmp_path / "ssd")
    with TieredKVCache(config(tmp_path / "ssd")) as cache:
        assert cache.ssd.recovering() and cache.stats()["occupancy"]["ssd"] == 0
        assert ssd_hits(cache, range(2)) == 0  # nothing verified yet: misses
        gate.set()
        assert cache.ssd.wait_ready(60)        # the tier's own wait; the next request seeds
        assert ssd_hits(cache, range(PROMPTS - 10, PROMPTS)) == 10 * BLOCKS


def test_wait_ready_holds_what_the_recovery_verified(tmp_path, gate):
    kill_after_filling(tmp_path / "ssd")
    with TieredKVCache(config(tmp_path / "ssd")) as cache:
        gate.set()
        t0 = time.monotonic()
        assert cache.wait_ready(60) and time.monotonic() - t0 < 60
        assert cache.stats()["occupancy"]["ssd"] >= PROMPTS * BLOCKS - 2 * BLOCKS
        assert ssd_hits(cache, range(PROMPTS - 5, PROMPTS)) == 5 * BLOCKS


def test_wait_ready_without_an_ssd_tier_is_true(tmp_path):
    cfg = KVStrataConfig.from_dict({"block_size": BS, "model": {"block_nbytes": NBYTES},
                                  "gpu": {"num_blocks": 4}, "cpu": {"capacity": 4 * NBYTES},
                                  "ssd": {"path": None}})
    with TieredKVCache(cfg) as cache:
        assert cache.ssd is None and cache.wait_ready(0)
