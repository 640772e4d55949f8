"""Deadlines of loads (kvstrata.core.costs, the copier, the executor): when a load is cut,
what a cut load still delivers and reports, and that nothing the SSD tier holds is lost by
a cut. The real engine over a throttled disk: ``benchmarks/bench_load_policy.py`` and
``tests/test_vllm_load_throttled.py``."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstrata.connectors.kit.kv_layout import KVLayout, LayoutRows
from kvstrata.dataplane.copier import Copier
from kvstrata.config.schema import KVStrataConfig
from kvstrata.core.costs import ALWAYS, MEASURED, PROBE_BYTES, PROBE_S, LoadCosts, load_costs
from kvstrata.dataplane.executor import READ_BATCH_BYTES, Executor
from kvstrata.policy import PolicySpec
from kvstrata.policy import LoadPlan
from kvstrata.policy.tiers import CPU
from kvstrata.system.streams import InlineStreams
from kvstrata.tiers.host import HostSlab
from kvstrata.tiers.ssd import SSDTier
from kvstrata.core.deployment import policy_spec

BT = 16


def costs(**kw: object) -> LoadCosts:
    c = LoadCosts(("cpu", "ssd"), policy=MEASURED, warmup=2, **kw)  # type: ignore[arg-type]
    for _ in range(3):
        c.step_done(2 * BT, 2 * BT * 0.001, BT)  # 1 ms a token: 16 ms a block, 32 ms a step
    return c


def test_a_deadline_is_a_factor_of_the_estimate_at_most_the_compute_and_at_least_two_steps() -> None:
    c = costs()
    # warm-up (no SSD estimate yet): computing the 20 blocks bounds it, 0.32 s
    assert abs(c.deadline(["ssd"] * 20, BT) - 0.32) < 1e-9
    # short hits: never under two steps (a load waits for the step it was handed over in)
    assert abs(c.deadline(["ssd"], BT) - 0.064) < 1e-9
    for _ in range(3):
        c.load_done({"ssd": 10}, 10 * 0.004)  # 4 ms a block
    assert abs(c.deadline(["ssd"] * 20, BT) - 2 * 20 * 0.004) < 1e-9  # 2x its estimate: 0.16 s
    for _ in range(3):
        c.load_done({"ssd": 10}, 10 * 0.1)    # the disk slowed to 100 ms a block
    assert abs(c.deadline(["ssd"] * 20, BT) - 0.32) < 0.01  # computing them is the bound again
    assert LoadCosts(("cpu",), policy=ALWAYS).deadline(["cpu"], BT) is None
    assert costs(deadline=0.0).deadline(["ssd"], BT) is None
    assert LoadCosts(("cpu",), policy=MEASURED).deadline(["cpu"], BT) is None  # no compute rate yet


def _tiers(tmp_path: Path, n: int) -> tuple[Executor, Copier, SSDTier, dict[str, torch.Tensor], list[bytes]]:
    kv = {f"layer.{i}": torch.zeros(n, 2, 64, 64) for i in range(2)}  # 64 KiB a block
    layout = KVLayout(kv, n)
    rows = LayoutRows(layout)
    ssd = SSDTier(tmp_path / "ssd", capacity_bytes=16 * 1024**2, block_nbytes=layout.block_nbytes,
                  fingerprint="fp", compression="none")
    keys = [bytes([i]) * 16 for i in range(n)]
    for i, k in enumerate(keys):
        assert ssd.put(k, np.full(layout.block_nbytes, i, np.uint8))
    ssd.flush()
    ex = Executor(rows, {"cpu": HostSlab(n, layout.block_nbytes, pin_memory=False), "ssd": ssd})
    return ex, Copier(ex, rows, InlineStreams()), ssd, kv, keys


def test_a_cut_read_stops_between_batches_and_loses_nothing_the_tier_holds(tmp_path: Path) -> None:
    ex, _, ssd, _, keys = _tiers(tmp_path, 48)
    batch = ex.read_batch
    assert batch == READ_BATCH_BYTES // ssd.block_nbytes and 48 >= 3 * batch
    n = 3 * batch
    promote = [i if i % 2 else -1 for i in range(n)]
    plan = LoadPlan(1, "r", list(range(n)), keys, [-1] * n, ["ssd"] * n, promote, slab="cpu")
    rows = np.zeros((n, ssd.block_nbytes), np.uint8)
    ok = [False] * n
    checks = iter([False, True])  # read the first batch, then the deadline passed
    lost = ex.read_keyed(plan, rows, ok, stop=lambda: next(checks))
    assert ok == [True] * batch + [False] * (n - batch)
    assert all((rows[i] == i).all() for i in range(batch))
    # no SSD block is lost; the promotions that received nothing are (the CPU tier must forget them)
    assert lost == [(CPU, keys[i]) for i in range(batch, n) if promote[i] >= 0]
    assert ex.stats()["blocks_cut_ssd"] == n - batch
    assert all(ssd.get(k) is not None for k in keys)


def test_the_copier_cuts_the_load_of_the_request_named_and_reports_what_moved(tmp_path: Path) -> None:
    ex, copier, ssd, kv, keys = _tiers(tmp_path, 48)
    n = 2 * ex.read_batch
    plan = LoadPlan(1, "r", list(range(n)), keys, [-1] * n, ["ssd"] * n, [-1] * n, slab="cpu")
    other = LoadPlan(2, "s", list(range(n)), keys, [-1] * n, ["ssd"] * n, [-1] * n, slab="cpu")
    copier.cut("r")  # nothing queued yet: a no-op
    copier.load(other)
    copier.load(plan)
    copier.cut("r")
    assert [j.cut.is_set() for j in copier._loading.jobs] == [False, True]  # noqa: SLF001
    done = copier.drain()
    assert done.loads["s"].loaded == n and done.loads["s"].read == {"ssd": n}
    assert done.loads["s"].seconds > 0
    got = done.loads["r"]
    assert got.loaded == sum(got.read.values()) < n or got.loaded == n  # cut before or after its reads ran
    copier.close()


def test_a_tier_judged_slow_is_probed_again_once_its_sample_is_old() -> None:
    now = [0.0]
    c = LoadCosts(("cpu", "ssd"), policy=MEASURED, warmup=1, clock=lambda: now[0])
    c.step_done(BT, BT * 0.001, BT)
    c.load_done({"ssd": 4}, 4 * 1.0)  # 1 s a block against 16 ms to compute it
    assert c.worth(["ssd"] * 4, BT) == 0
    now[0] = PROBE_S + 1
    assert c.worth(["ssd"] * 4, BT) == 1  # a probe: its first block is loaded, the rest computed
    assert c.worth(["ssd"] * 4, BT) == 0  # one request probes
    c.load_done({"ssd": 1}, 0.0001)       # the probe found the disk fast again
    assert c.worth(["ssd"] * 4, BT) == 4


def test_a_probe_reads_a_few_blocks_of_its_tier_after_what_is_worth_loading() -> None:
    """A DRAM prefix, then a slow SSD tail due for a probe: the prefix and the probe's
    blocks (``probe_blocks``, from ``PROBE_BYTES``) are loaded, the rest of the tail is
    computed. A probe that read the whole tail cost a request its whole read (at 6 MiB/s,
    2.6 s against 0.5 s to compute, on the CPU engine)."""
    now = [0.0]
    c = LoadCosts(("cpu", "ssd"), policy=MEASURED, warmup=1, probe_blocks=2, clock=lambda: now[0])
    c.step_done(BT, BT * 0.001, BT)
    c.load_done({"cpu": 4}, 4 * 0.0001)
    c.load_done({"ssd": 4}, 4 * 1.0)
    assert c.worth(["cpu"] * 3 + ["ssd"] * 8, BT) == 3
    now[0] = PROBE_S + 1
    assert c.worth(["cpu"] * 3 + ["ssd"] * 8, BT) == 5
    assert c.worth(["ssd"] * 1, BT) == 0  # probed
    now[0] = 2 * PROBE_S + 2
    assert c.worth(["ssd"] * 1, BT) == 1  # a hit shorter than a probe: all of it
    # a tier with a latency (its loads differ in size) is still probed: what the probe pays
    # for its latency does not cut the probe's blocks off
    now[0] = 3 * PROBE_S + 3
    c.load_done({"ssd": 1}, 0.5 + 1.0)  # the probe's sample (a fresh fit), then a longer load
    c.load_done({"ssd": 4}, 0.5 + 4.0)
    assert c.latency()["ssd"] == pytest.approx(0.5)
    now[0] = 4 * PROBE_S + 4
    assert c.worth(["cpu"] * 3 + ["ssd"] * 8, BT) == 5
    cfg = KVStrataConfig.from_dict({})
    spec = policy_spec(cfg, block_nbytes=4096, gpu_blocks=16)
    assert load_costs(cfg.load, spec, 512 * 1024).probe_blocks == PROBE_BYTES // (512 * 1024) == 2
    assert load_costs(cfg.load, spec, 4 << 20).probe_blocks == 1


def test_a_fetch_from_a_slow_server_stops_between_chunks(tmp_path: Path) -> None:
    """A real Valkey server behind a proxy that delivers 2 MiB/s: a fetch told to stop after
    its first chunk brings that chunk alone, and the slots of the rest hold nothing."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from slow_proxy import SlowProxy
    from valkey_server import ValkeyServer

    from kvstrata.policy import FetchPlan
    from kvstrata.config.remote import RemoteConfig
    from kvstrata.tiers.remote import RemoteTier, key_prefix

    nb = 256 * 1024
    n = 3 * (READ_BATCH_BYTES // nb)
    keys = [bytes([i]) * 32 for i in range(n)]
    rows = np.random.default_rng(0).integers(0, 256, (n, nb), dtype=np.uint8)
    with ValkeyServer() as server:
        writer = RemoteTier(RemoteConfig(url=server.url, timeout=5.0), key_prefix("fp"), nb)
        for k, r in zip(keys, rows):
            assert writer.put(k, r)
        assert writer.flush(30)
        writer.close()
        with SlowProxy(server.port, bps=2 << 20) as proxy:
            slow = RemoteConfig(url=f"redis://127.0.0.1:{proxy.port}/0", timeout=30.0)
            remote = RemoteTier(slow, key_prefix("fp"), nb)
            slab = HostSlab(n, nb, pin_memory=False)
            ex = Executor(None, {"cpu": slab, "remote": remote})
            plan = FetchPlan(1, req_id="r", keys=keys, slots=list(range(n)), source="remote", slab="cpu")
            checks = iter([False, True])
            got = ex.fetch(plan, stop=lambda: next(checks, True))
            assert got == ex.read_batch == READ_BATCH_BYTES // nb
            assert all(slab.holds(i, keys[i]) for i in range(got))
            assert not any(slab.holds(i, keys[i]) for i in range(got, n))
            remote.close()


def test_the_scheduler_names_a_fetch_past_its_deadline_once() -> None:
    from kvstrata.connectors.kit.transfer_costs import TransferTiming
    from kvstrata.policy import FetchPlan

    now = [0.0]
    c = LoadCosts(("cpu", "ssd"), "remote", policy=MEASURED, warmup=1, token_seconds=0.001,
                  block_seconds={"cpu": 0.001})
    timing = TransferTiming(c, BT, clock=lambda: now[0])
    plan = FetchPlan(7, req_id="r", keys=[b"k"] * 4, slots=[0, 1, 2, 3], source="remote", slab="cpu")
    assert timing.step(0, [plan]) == []       # computing 4 blocks: 64 ms, the fetch's deadline
    now[0] = 0.05
    assert timing.step(0, []) == []
    now[0] = 0.07
    assert timing.step(0, []) == ["r"]
    now[0] = 0.2
    assert timing.step(0, []) == []           # named once
    timing.fetched(plan, 1)                   # what arrived is still a sample
    assert c.block_seconds()["remote"] == pytest.approx(0.2 + 0.001)  # its fetch, then its load from DRAM


def _serve_one_at_a_time(timing, now: list[float], idle_s: float) -> None:
    """Six prompts of 1-6 blocks, one at a time: each computed in one step (1 ms a token),
    its output, then the engine idles until the next arrives (``idle_s`` times 1 to 4: how
    long other clients take)."""
    for k in range(7):  # the first computing step is not timed
        tokens = BT * (k % 6 + 1)
        timing.step(tokens, [])
        now[0] += 0.001 * tokens
        timing.ended()                        # vLLM's take_events, with the step's output
        timing.ended()                        # a finished request of it: the first mark counts
        now[0] += idle_s * (1 + (k * 3) % 4)
    timing.step(0, [])


def test_a_step_is_timed_to_its_output_not_through_the_idle_engine_after_it() -> None:
    """An engine serving one request at a time waits between them; that wait is not
    compute (timing it as such made every hit look worth loading)."""
    from kvstrata.connectors.kit.transfer_costs import TransferTiming

    now = [0.0]
    c = LoadCosts(("cpu", "ssd"), policy=MEASURED, warmup=1)
    _serve_one_at_a_time(TransferTiming(c, BT, clock=lambda: now[0]), now, idle_s=2.0)
    assert c.token_seconds() == pytest.approx(0.001, rel=1e-6)

    now = [0.0]  # asynchronous scheduling: outputs come after the next step, steps run back to back
    c = LoadCosts(("cpu", "ssd"), policy=MEASURED, warmup=1)
    _serve_one_at_a_time(TransferTiming(c, BT, clock=lambda: now[0], async_scheduling=True), now, idle_s=0.0)
    assert c.token_seconds() == pytest.approx(0.001, rel=1e-6)
    now = [0.0]  # ... whose marks are not used: an idle engine's wait would be counted
    c = LoadCosts(("cpu", "ssd"), policy=MEASURED, warmup=1)
    _serve_one_at_a_time(TransferTiming(c, BT, clock=lambda: now[0], async_scheduling=True), now, idle_s=2.0)
    assert c.token_seconds() != pytest.approx(0.001, rel=0.5)


def test_a_grouped_load_is_bounded_by_computing_its_positions_not_its_entries() -> None:
    """A hybrid's load moves every group's blocks: 12 entries over 4 positions. Its deadline
    is what computing the 4 positions takes (64 ms), not 12 (192 ms)."""
    from kvstrata.connectors.kit.transfer_costs import TransferTiming

    now = [0.0]
    c = LoadCosts(("cpu", "ssd"), policy=MEASURED, warmup=1, token_seconds=0.001)
    plan = LoadPlan(3, req_id="r", block_ids=list(range(12)), keys=[bytes([i]) * 16 for i in range(12)],
                    slots=[-1] * 12, sources=["ssd"] * 12, promote_slots=[-1] * 12)
    timing = TransferTiming(c, BT, clock=lambda: now[0], span_of=lambda p: 4)
    assert timing.step(0, [plan]) == []
    now[0] = 0.07
    assert timing.step(0, []) == ["r"]
    assert abs(c.deadline(["ssd"] * 12, BT, 0, blocks=4) - 0.064) < 1e-9
    assert abs(c.deadline(["ssd"] * 12, BT) - 0.192) < 1e-9


class _TimedEvent:
    """Stands in for a CUDA event recorded with timing (there is no GPU here; the real one is
    checked by tests/test_copier_gpu.py on a device): complete, and 250 ms after any start."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: "_TimedEvent") -> float:
        return 250.0  # milliseconds, as torch.cuda.Event.elapsed_time gives them


class _TimedStream:
    def submit(self, fn) -> None:
        fn()

    def record(self, timed: bool = False) -> object:
        return _TimedEvent()

    def wait(self, event: object) -> None:
        return None


class _TimedStreams(InlineStreams):
    def __init__(self) -> None:
        self._stream = _TimedStream()


def test_a_device_that_times_its_copies_reports_their_device_time(tmp_path: Path) -> None:
    """Where the copy into the device blocks is asynchronous (a GPU), the load's seconds are
    the SSD reads plus the device's own time for the copies, between two timed events on the
    load stream, not the host's time to queue them."""
    ex, _, ssd, _, keys = _tiers(tmp_path, 4)
    copier = Copier(ex, ex.device, _TimedStreams())
    plan = LoadPlan(1, "r", [0, 1], keys[:2], [-1, -1], ["ssd", "ssd"], [-1, -1], slab="cpu")
    copier.load(plan)
    deadline = time.monotonic() + 10
    result = None
    while result is None and time.monotonic() < deadline:
        result = copier.poll().loads.get("r")
        time.sleep(0.001)
    assert result is not None and result.loaded == 2
    assert 0.25 <= result.seconds < 0.25 + 5, result.seconds  # the reads (ms here) + 250 ms of device time
    copier.close()
    ssd.close()


def test_the_scheduler_keeps_each_load_in_the_read_queue_from_hand_over_to_its_end() -> None:
    from kvstrata.connectors.kit.transfer_costs import TransferTiming

    now = [0.0]
    c = LoadCosts(("cpu", "ssd"), policy=MEASURED, warmup=1, token_seconds=0.001,
                  block_seconds={"cpu": 0.001, "ssd": 0.01}, clock=lambda: now[0])
    timing = TransferTiming(c, BT, clock=lambda: now[0])
    ssd = LoadPlan(4, "r", list(range(6)), [bytes([i]) * 16 for i in range(6)], [0, 1, -1, -1, -1, -1],
                   ["cpu", "cpu", "ssd", "ssd", "ssd", "ssd"], [-1] * 6)
    timing.step(0, [ssd])
    assert c.queued() == pytest.approx(0.04)  # 4 SSD blocks at 10 ms; the 2 DRAM ones queue on nothing
    timing.loaded(ssd)
    assert c.queued() == 0.0
