"""Replay through the real TieredKVCache: per-tier hits, miss reasons, lifecycle, GPU pressure."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.bench.replay import ReplayOptions, config_for_trace, replay, tier_capacities
from kvstrata.trace.reader import TraceBuilder, load_trace
from kvstrata.bench.workloads import generate
from kvstrata.config.schema import KVStrataConfig

DATA = Path(__file__).parent / "data"


def cfg(tmp_path: Path, *, gpu: int = 3, cpu: int = 0, ssd: int = 0) -> KVStrataConfig:
    """Block size 4 tokens, 1 KiB per block; capacities in blocks."""
    return KVStrataConfig.from_dict({
        "block_size": 4, "model": {"block_nbytes": 1024}, "gpu": {"num_blocks": gpu},
        "cpu": {"capacity": cpu * 1024}, "ssd": {"path": str(tmp_path / "ssd"), "capacity": ssd * 1024}})


def tiers_trace():  # [1,2] [3,4] [5,6] [1,2], one second apart, each finished before the next arrives
    return load_trace(DATA / "tiers.jsonl", block_size=4)


def test_gpu_hits_and_trace_reuse(tmp_path: Path) -> None:
    b = TraceBuilder("t", "mooncake", 4)
    for ts, ids in [(0, [1, 2, 3]), (1, [1, 2, 4]), (2, [5]), (3, [1, 2, 3])]:
        b.add_ids(float(ts), ids, 4 * len(ids), 0)
    r = replay(b.build(), cfg(tmp_path, gpu=100))
    assert r.hit_blocks == {"gpu": 5, "cpu": 0, "ssd": 0} and r.accesses == 10
    assert r.hit_rate()["total"] == 0.5
    assert r.miss_reasons["new"] == 5 and sum(r.miss_reasons.values()) == 5
    assert sorted(r.lifecycle("gpu", "reuse_gap_s")) == [1.0, 1.0, 2.0, 2.0, 3.0]


@pytest.mark.parametrize("cpu, ssd, hits, reason", [
    (10, 0, {"gpu": 0, "cpu": 2, "ssd": 0}, None),            # spilled to DRAM, promoted back
    (2, 100, {"gpu": 0, "cpu": 0, "ssd": 2}, None),           # pushed out of DRAM, still on SSD
    (2, 0, {"gpu": 0, "cpu": 0, "ssd": 0}, "evicted_cpu"),    # gone: DRAM was the last tier
    (0, 0, {"gpu": 0, "cpu": 0, "ssd": 0}, "evicted_gpu"),    # no lower tier at all
])
def test_hits_come_from_the_tier_that_kept_the_block(tmp_path: Path, cpu: int, ssd: int,
                                                      hits: dict[str, int], reason: str | None) -> None:
    # a 2-block pool holds one request: [1,2] leaves the GPU
    r = replay(tiers_trace(), cfg(tmp_path, gpu=2, cpu=cpu, ssd=ssd))
    assert r.hit_blocks == hits
    assert r.miss_reasons["new"] == 6
    if reason:
        assert r.miss_reasons[reason] == 2
        assert len(r.cache_lifetime_s) >= 2 and min(r.cache_idle_before_evict_s) >= 1.0


def test_payload_mode_moves_bytes_with_the_same_hits(tmp_path: Path) -> None:
    r = replay(tiers_trace(), cfg(tmp_path, gpu=2, cpu=10), ReplayOptions(payload=True, payload_block_bytes=4096))
    assert r.hit_blocks == {"gpu": 0, "cpu": 2, "ssd": 0}
    assert r.payload_block_bytes == 4096


def test_payload_replay_forgets_what_the_ssd_tier_dropped_on_its_own(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A record the SSD tier drops by itself (a corrupt page found by its writer, its capacity
    backstop) is reported through take_lost; the replay, like the library and the connector,
    forgets it, so the policy never plans a load of it. The drop is injected (it cannot be
    produced on demand): the tier reports its oldest record, block 1 of [1,2], once."""
    from kvstrata.tiers.ssd import SSDTier

    real = SSDTier.take_lost
    reported: list[bytes] = []

    def take_lost(self: SSDTier) -> list[bytes]:
        keys = real(self)
        self.flush()  # committed records only are listed
        oldest = next(iter(self.keys()), None)
        if not reported and oldest is not None:
            self.discard_many([oldest])
            reported.append(oldest)
            keys.append(oldest)
        return keys

    monkeypatch.setattr(SSDTier, "take_lost", take_lost)
    r = replay(tiers_trace(), cfg(tmp_path, gpu=2, cpu=2, ssd=2000),
               ReplayOptions(payload=True, payload_block_bytes=1024))
    assert reported and r.hit_blocks == {"gpu": 0, "cpu": 0, "ssd": 0}
    assert r.stats["corrupt_blocks"]["ssd"] == 1


def test_running_requests_are_finished_early_when_the_pool_is_full(tmp_path: Path) -> None:
    b = TraceBuilder("t", "mooncake", 4)
    b.add_ids(0.0, [1, 2], 8, 1000)       # runs for 20 s at 20 ms/token
    b.add_ids(1.0, [3, 4], 8, 1000)       # needs the whole pool
    r = replay(b.build(), cfg(tmp_path, gpu=3))
    assert r.forced_frees == 1 and r.peak_running == 1


def test_request_larger_than_the_pool_is_rejected_and_counted(tmp_path: Path) -> None:
    r = replay(tiers_trace(), cfg(tmp_path, gpu=1))  # every request needs 2 blocks
    assert r.rejected == 4 and r.rejected_max_blocks == 2
    assert r.miss_reasons["rejected"] == 8 and r.hits == 0
    assert r.admit_hint is not None and "--set gpu.num_blocks=2" in r.admit_hint


def test_capacities_keep_tokens_when_the_block_size_changes() -> None:
    base = KVStrataConfig()                                  # 1024 blocks of 16 tokens, 8 GiB DRAM, 2 MiB blocks
    c = config_for_trace(base, 512)
    caps = tier_capacities(c)
    assert c.block_size == 512 and caps["gpu"] == 1024 * 16 // 512
    assert caps["cpu"] == 8 * 1024**3 // (512 * 131072)


def test_default_workload_hits_every_tier_of_the_default_deployment() -> None:
    from kvstrata.bench.deployment import default_config

    r = replay(generate("mixed", 0), default_config())
    assert all(r.hit_blocks[t] > 0 for t in ("gpu", "cpu", "ssd")), r.hit_blocks
    assert r.forced_frees == 0


def test_default_deployment_keeps_its_pool_unless_its_size_is_overridden() -> None:
    from kvstrata.bench.deployment import default_config

    assert default_config(["gpu.device=cpu"]).gpu.capacity == 22 * 1024**3
    sized = default_config(["gpu.num_blocks=64"]).gpu
    assert (sized.num_blocks, sized.capacity) == (64, None)
    assert default_config(["gpu.capacity=8GiB"]).gpu.capacity == 8 * 1024**3


@pytest.mark.parametrize("block_bytes", [1024, 4096, 16384, 100_000])
def test_payload_tiers_hold_as_many_blocks_as_the_replayed_ones(tmp_path: Path, block_bytes: int) -> None:
    from kvstrata.bench.payload import payload_config

    c = cfg(tmp_path, gpu=8, cpu=5, ssd=3000)
    assert tier_capacities(payload_config(c, block_bytes, str(tmp_path))) == tier_capacities(c)


def test_metadata_replay_memory_follows_blocks_used_not_capacity(tmp_path: Path) -> None:
    """10 TB of SSD and 1 TB of DRAM in 1 KiB blocks are ~10^10 slots: the metadata replay
    must cost what the trace's blocks cost (it used to allocate per configured slot)."""
    import tracemalloc

    def peak(cpu: int, ssd: int) -> int:
        tracemalloc.start()
        try:
            r = replay(tiers_trace(), cfg(tmp_path, gpu=2, cpu=cpu, ssd=ssd))
            assert r.hit_blocks["cpu"] + r.hit_blocks["ssd"] == 2
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    small, huge = peak(10, 100), peak(2**30, 10 * 2**30)
    assert huge < small + 1024**2, (small, huge)


def test_a_cpu_hit_keeps_the_ssd_copy(tmp_path: Path) -> None:
    """A, B, C, B, D, B, E, F, B (one block each, one second apart; GPU 1, CPU 2, SSD 3
    blocks, write-through): B stays hot through CPU hits alone. Those refresh its SSD copy,
    so when the CPU tier finally evicts B the SSD tier still holds it and the last B is an
    SSD hit (it used to age out of the SSD tier while hot in DRAM: a miss, evicted_cpu)."""
    b = TraceBuilder("t", "mooncake", 4)
    for ts, block in enumerate([1, 2, 3, 2, 4, 2, 5, 6, 2]):
        b.add_ids(float(ts), [block], 4, 0)
    config = KVStrataConfig.from_dict({  # 4 KiB: three 1 KiB records with their index entries
        "block_size": 4, "model": {"block_nbytes": 1024}, "gpu": {"num_blocks": 1},
        "cpu": {"capacity": 2048}, "ssd": {"path": str(tmp_path / "ssd"), "capacity": 4096}})
    r = replay(b.build(), config)
    assert r.capacity_blocks["cpu"] == 2 and r.capacity_blocks["ssd"] == 3, r.capacity_blocks
    assert r.hit_blocks == {"gpu": 0, "cpu": 2, "ssd": 1}, r.hit_blocks  # B, B from DRAM; the last B from SSD
    assert r.miss_reasons.get("evicted_cpu", 0) == 0, r.miss_reasons


@pytest.mark.parametrize("preempted", [False, True])
def test_a_recorded_preemption_frees_the_blocks_and_looks_the_request_up_again(tmp_path: Path,
                                                                                 preempted: bool) -> None:
    """A (2 blocks, 10 s) is preempted from 1 s to 5 s; B (2 blocks) arrives at 2 s in a
    3-block pool. Preempted, A leaves B room (no request is finished early) and, resumed,
    finds its first block still cached: a hit counted apart from the hit rate's."""
    b = TraceBuilder("t", "kvstrata", 4)
    b.add_ids(0, [1, 2], 8, 1, 1, output_ids=[], duration=10, hittable=1,
              preemptions=[(1.0, 5.0, 8)] if preempted else None)
    b.add_ids(2, [3, 4], 8, 1, 2, output_ids=[], duration=1, hittable=1)
    r = replay(b.build(), cfg(tmp_path, gpu=3))
    assert r.hits == 0
    if preempted:  # B took the never-used block and A's last (freed tail first); A's first stayed
        assert r.forced_frees == 0 and r.preempted_hit_blocks["gpu"] == 1
    else:
        assert r.forced_frees == 1 and sum(r.preempted_hit_blocks.values()) == 0


def test_making_room_for_a_resumed_request_finishes_a_request_that_holds_blocks(tmp_path: Path) -> None:
    """A resumes at 5 s while B (arrived during A's preemption, running until 102 s) holds
    two of the three blocks: B is finished early, not A (which finishes first but holds
    nothing while it is being resumed)."""
    b = TraceBuilder("t", "kvstrata", 4)
    b.add_ids(0, [1, 2], 8, 1, 1, output_ids=[], duration=10, hittable=1, preemptions=[(1.0, 5.0, 8)])
    b.add_ids(2, [3, 4], 8, 1, 2, output_ids=[], duration=100, hittable=1)
    b.add_ids(20, [1, 2], 8, 1, 3, output_ids=[], duration=1, hittable=1)  # A's prefix, A long finished
    r = replay(b.build(), cfg(tmp_path, gpu=3))
    assert r.forced_frees == 1
    assert r.hit_blocks["gpu"] == 1  # A was resumed, ran and was freed: its first block is cached


@pytest.mark.parametrize("admission", ["always", "second_hit"])
@pytest.mark.parametrize("eviction", ["lru", "s3fifo", "arc", "cost:2"])
def test_payload_replay_agrees_with_the_metadata_replay_under_every_order(tmp_path: Path, eviction: str,
                                                                          admission: str) -> None:
    """The library's executor (real bytes, a real LMDB) and the bytes-free replay serve the same
    hits per tier under a non-default eviction order and admission."""
    from kvstrata.bench.workloads import generate

    trace = generate("chat", 0, block_size=4, scale=0.05)
    base = cfg(tmp_path, gpu=512, cpu=256, ssd=4000)
    config = KVStrataConfig.from_dict(base.to_dict(), [f"cpu.eviction={eviction}", f"ssd.eviction={eviction}",
                                                       f"ssd.admission={admission}", "spill.write_through=false"])
    meta = replay(trace, config)
    real = replay(trace, config, ReplayOptions(payload=True, payload_block_bytes=4096))
    assert real.hit_blocks == meta.hit_blocks
    assert meta.hit_blocks["cpu"] + meta.hit_blocks["ssd"] > 0  # the lower tiers served some
    assert real.stats["admissions_rejected"] == meta.stats["admissions_rejected"]
