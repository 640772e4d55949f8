"""A read of the SSD tier that does not return: the load deadline still holds.

The tier is real (LMDB index and page file on disk, in a temp dir); what is stubbed is
the page file's ``read_into`` and ``read`` (its ``preadv`` and ``pread``), wrapped so that a read waits on an Event
before it runs: a disk that stops answering cannot be made here without root (no FUSE,
no device-mapper). Released, the real read runs and returns real bytes.

* the load is reported at its cut, with what was in, whatever the I/O thread is doing,
  and nothing its read brings later reaches the device blocks or the slab slots it was
  promoting into (they are poisoned after the report and checked after the release);
* the load-or-recompute decision sends new hits of the stalled tier to compute (a DRAM
  hit is still loaded), counts the stuck read's age as ahead of them, and takes the tier
  back after a probe of it succeeds;
* a fetch from the remote tier (a real valkey-server) queued during the stall arrives on
  time: fetches do not queue behind a disk read.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from kvstrata.connectors.kit.kv_layout import KVLayout, LayoutRows
from kvstrata.dataplane.copier import Copier
from kvstrata.core.costs import MEASURED, LoadCosts
from kvstrata.dataplane.executor import Executor
from kvstrata.policy import FetchPlan, LoadPlan
from kvstrata.system.streams import InlineStreams
from kvstrata.tiers.host import HostSlab
from kvstrata.tiers.ssd import SSDTier
from kvstrata.tiers.ssd.pagefile import PageFile

sys.path.insert(0, str(Path(__file__).parent))

BT = 16
N = 8            # blocks of the device pool and of the tier
DEADLINE = 0.1   # seconds after hand-over at which the load is cut (what the scheduler half names)
MARGIN = 0.25    # seconds the report may come after the cut (polling, this machine's noise)


class StuckDisk:
    """Reads of the page file wait until :meth:`release` (see the module docstring)."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.entered = threading.Event()
        self.returned = threading.Event()

    def release(self) -> None:
        self.go.set()


@pytest.fixture
def stuck(monkeypatch: pytest.MonkeyPatch) -> Iterator[StuckDisk]:
    disk = StuckDisk()

    def stuck_read(real: Any) -> Any:
        def read(self: PageFile, *args: Any) -> Any:
            disk.entered.set()
            disk.go.wait(60)
            try:
                return real(self, *args)
            finally:
                disk.returned.set()
        return read

    monkeypatch.setattr(PageFile, "read_into", stuck_read(PageFile.read_into))
    monkeypatch.setattr(PageFile, "read", stuck_read(PageFile.read))
    yield disk
    disk.release()


def _rig(tmp_path: Path, remote: Any = None) -> tuple[Copier, SSDTier, dict[str, torch.Tensor], HostSlab, list[bytes]]:
    kv = {f"layer.{i}": torch.zeros(N, 2, 64, 64) for i in range(2)}  # 64 KiB a block
    layout = KVLayout(kv, N)
    rows = LayoutRows(layout)
    ssd = SSDTier(tmp_path / "ssd", capacity_bytes=16 * 1024**2, block_nbytes=layout.block_nbytes,
                  fingerprint="fp", compression="none")
    keys = [bytes([i + 1]) * 16 for i in range(N)]
    for i, k in enumerate(keys):
        assert ssd.put(k, np.full(layout.block_nbytes, i + 1, np.uint8))
    assert ssd.flush()
    slab = HostSlab(N, layout.block_nbytes, pin_memory=False)
    return Copier(Executor(rows, {"cpu": slab, "ssd": ssd, "remote": remote}), rows, InlineStreams()), ssd, kv, slab, keys


def _poll_until(copier: Copier, what: str, key: Any, limit_s: float) -> tuple[Any, float]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        done = copier.poll()
        got = getattr(done, what)
        if (key in got) if isinstance(got, (dict, list)) else got:
            return got[key] if isinstance(got, dict) else key, time.monotonic() - t0
        time.sleep(0.002)
    raise AssertionError(f"nothing in {what} for {key!r} after {limit_s} s")


def _device(kv: dict[str, torch.Tensor], block: int) -> bytes:
    return b"".join(t[block].numpy().tobytes() for t in kv.values())


def test_a_stuck_read_is_reported_at_the_cut_and_writes_nothing_after_it(tmp_path: Path, stuck: StuckDisk) -> None:
    copier, ssd, kv, slab, keys = _rig(tmp_path)
    nb = ssd.block_nbytes
    # blocks 0-1 from the slab (filled now), 2-5 from the SSD tier, block 4 promoted into slot 6
    slab.write([0, 1], keys[:2], np.stack([np.full(nb, 1, np.uint8), np.full(nb, 2, np.uint8)]), [0, 1])
    plan = LoadPlan(1, "r", [0, 1, 2, 3, 4, 5], keys[:6], [0, 1, -1, -1, -1, -1], ["cpu", "cpu"] + ["ssd"] * 4,
                    [-1, -1, -1, -1, 6, -1], slab="cpu")
    t0 = time.monotonic()
    copier.load(plan)
    assert stuck.entered.wait(5), "the read never started"
    while time.monotonic() - t0 < DEADLINE:
        assert "r" not in copier.poll().loads
        time.sleep(0.005)
    copier.cut("r")  # the scheduler half names the load past its deadline
    result, waited = _poll_until(copier, "loads", "r", DEADLINE + 5)
    assert waited < MARGIN, f"reported {waited:.3f} s after the cut"
    assert result.loaded == 2 and result.stalled  # the slab prefix is in; the SSD blocks are not
    assert _device(kv, 0) == bytes([1]) * nb and _device(kv, 1) == bytes([2]) * nb
    assert not stuck.returned.is_set()
    # vLLM may hand blocks 2-5 to another request at once; the policy may reuse slot 6
    for b in range(2, 6):
        for t in kv.values():
            t[b].fill_(-7.0)
    poison = {b: _device(kv, b) for b in range(2, 6)}
    other = np.full(nb, 0xAB, np.uint8)
    slab.write([6], [b"other-block-key!"], other[None], [0])
    stuck.release()
    assert stuck.returned.wait(5)
    assert _poll_until(copier, "returned", "r", 5)[0] == "r"
    assert {b: _device(kv, b) for b in range(2, 6)} == poison  # the late read wrote no device block
    assert slab.holds(6, b"other-block-key!") and bytes(slab.view(6)) == bytes(other)  # nor the slot
    assert all(ssd.get(k) is not None for k in keys)  # the tier lost nothing to the cut
    copier.close()
    ssd.close()


def test_a_load_queued_behind_a_stuck_read_is_reported_at_its_own_cut(tmp_path: Path, stuck: StuckDisk) -> None:
    copier, ssd, kv, _, keys = _rig(tmp_path)
    first = LoadPlan(1, "a", [0, 1], keys[:2], [-1, -1], ["ssd", "ssd"], [-1, -1], slab="cpu")
    second = LoadPlan(2, "b", [2, 3], keys[2:4], [-1, -1], ["ssd", "ssd"], [-1, -1], slab="cpu")
    copier.load(first)
    copier.load(second)
    assert stuck.entered.wait(5)
    copier.cut("a")
    copier.cut("b")
    t0 = time.monotonic()
    done: dict[str, Any] = {}
    while len(done) < 2 and time.monotonic() - t0 < 5:
        done.update(copier.poll().loads)
        time.sleep(0.002)
    assert time.monotonic() - t0 < MARGIN and set(done) == {"a", "b"}
    assert done["a"].loaded == done["b"].loaded == 0 and done["a"].stalled and done["b"].stalled
    stuck.release()
    copier.drain(10)
    copier.close()
    ssd.close()


def _measured(now: list[float]) -> LoadCosts:
    c = LoadCosts(("cpu", "ssd"), policy=MEASURED, warmup=1, probe_blocks=2, clock=lambda: now[0])
    c.step_done(BT, BT * 0.001, BT)           # 16 ms to compute a block
    c.load_done({"cpu": 4}, 4 * 0.0001)
    c.load_done({"ssd": 4}, 4 * 0.002)        # 2 ms to read one: SSD hits are worth loading
    return c


def test_a_stalled_tier_sends_new_hits_to_compute_until_a_probe_succeeds() -> None:
    from kvstrata.connectors.kit.transfer_costs import TransferTiming

    now = [100.0]
    costs = _measured(now)
    timing = TransferTiming(costs, BT, clock=lambda: now[0])
    hit = ["ssd"] * 8
    assert costs.worth(hit, BT) == 8
    plan = LoadPlan(3, "r", list(range(4)), [bytes([i]) * 16 for i in range(4)], [-1] * 4, ["ssd"] * 4, [-1] * 4)
    assert timing.step(0, [plan]) == []
    now[0] += 0.5
    assert timing.step(0, []) == ["r"]        # past its deadline: cut
    timing.stalled(plan)                      # the workers gave it up with its read still out
    timing.loaded(plan)
    now[0] += 0.2
    assert costs.queued() >= 0.7              # the stuck read's age is ahead of any new read
    assert costs.worth(hit, BT) == 0          # a new SSD hit is computed
    assert costs.worth(["cpu"] * 3 + hit, BT) == 3  # a DRAM prefix is still loaded
    assert costs.decisions  # (counted by the caller)
    now[0] += 60
    assert costs.queued() >= 60               # still out: never falls to 0
    timing.returned("r")                      # the read came back
    assert costs.queued() == 0.0
    assert costs.worth(hit, BT) == 2          # the breaker lets one probe through: 2 blocks
    assert costs.worth(hit, BT) == 0          # one probe at a time
    costs.load_done({"ssd": 2}, 2 * 0.002)    # the probe read them in time
    assert costs.worth(hit, BT) == 8          # the tier is back


def test_a_failed_probe_keeps_the_tier_out_longer() -> None:
    now = [100.0]
    costs = _measured(now)
    costs.stalled(1, ["ssd"])
    assert costs.worth(["ssd"] * 8, BT) == 0
    now[0] += 1.5
    assert costs.worth(["ssd"] * 8, BT) == 2  # the probe
    costs.stalled(2, ["ssd"])                 # ... stalled too
    now[0] += 1.5
    assert costs.worth(["ssd"] * 8, BT) == 0  # out for twice the cooldown now
    now[0] += 1.0
    assert costs.worth(["ssd"] * 8, BT) == 2


def test_a_fetch_queued_during_the_stall_arrives_on_time(tmp_path: Path, stuck: StuckDisk) -> None:
    from valkey_server import ValkeyServer

    from kvstrata.config.remote import RemoteConfig
    from kvstrata.tiers.remote import RemoteTier, key_prefix

    nb = 64 * 1024
    rkeys = [bytes([0xF0 + i]) * 32 for i in range(2)]
    rows = np.random.default_rng(0).integers(0, 256, (2, nb), dtype=np.uint8)
    with ValkeyServer() as server:
        remote = RemoteTier(RemoteConfig(url=server.url, timeout=5.0), key_prefix("fp"), nb)
        for k, r in zip(rkeys, rows):
            assert remote.put(k, r)
        assert remote.flush(30)
        copier, ssd, _, slab, keys = _rig(tmp_path, remote=remote)
        copier.load(LoadPlan(1, "r", [0, 1], keys[:2], [-1, -1], ["ssd", "ssd"], [-1, -1], slab="cpu"))
        assert stuck.entered.wait(5)
        fetch = FetchPlan(2, req_id="s", keys=rkeys, slots=[4, 5], writes={"ssd": [0]}, source="remote", slab="cpu")
        copier.fetch(fetch)
        got, waited = _poll_until(copier, "fetched", 2, 5)
        assert got == 2 and waited < 2.0 and not stuck.returned.is_set()
        assert bytes(slab.view(4)) == bytes(rows[0]) and bytes(slab.view(5)) == bytes(rows[1])
        copier.cut("r")
        stuck.release()
        copier.drain(10)
        copier.close()
        ssd.close()
        remote.close()


def test_the_two_step_floor_of_a_deadline_is_the_step_it_is_handed_over_in() -> None:
    """Prefills of seconds (a slow CPU engine) made the mean step long, and every deadline
    at least two of them: a stalled read then held a request that long. A load handed over
    in a step that computes nothing is bounded by its estimate alone."""
    now = [100.0]
    costs = _measured(now)
    for _ in range(5):
        costs.step_done(4000, 4.0, BT)      # prefills of 4 s
    hit = ["ssd"] * 21
    assert costs.deadline(hit, BT) >= 2 * 4.0 * 0.6
    assert costs.deadline(hit, BT, step_tokens=0) == pytest.approx(2 * 21 * 0.002, rel=0.01)
    assert costs.deadline(hit, BT, step_tokens=4000) == costs.deadline(hit, BT)
