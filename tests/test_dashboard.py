"""dashboards/kvstrata.json cannot drift from the code: every series it queries is one kvstrata
exports (vLLM's /metrics through the connector's stats, or kvstrata's own endpoint), and it
is well formed for Grafana. The long test in test_vllm_server.py checks the same names
against a live scrape of the real API server."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

DASHBOARD = Path(__file__).resolve().parents[1] / "dashboards" / "kvstrata.json"
SERIES = re.compile(r"\b((?:kvstrata|vllm):[a-z_]+)")


def dashboard_series() -> set[str]:
    """Every series name the dashboard's queries use (as Prometheus stores them)."""
    d = json.loads(DASHBOARD.read_text())
    return {m for p in d["panels"] for t in p["targets"] for m in SERIES.findall(t["expr"])}


def test_dashboard_is_well_formed() -> None:
    d = json.loads(DASHBOARD.read_text())
    assert d["uid"] == "kvstrata" and d["panels"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"]), p["title"]
        assert p["gridPos"]["w"] > 0 and p["gridPos"]["h"] > 0


@pytest.mark.vllm
def test_every_series_the_dashboard_queries_is_exported() -> None:
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    from kvstrata.connectors.vllm.metrics import SERIES as CONNECTOR
    from kvstrata.core.metrics import KVStrataCollector

    exported = {f"kvstrata:{s.name}" + ("" if s.gauge else "_total") for s in CONNECTOR}
    # kvstrata's own endpoint (metrics.port): what its collector renders for a library cache
    from kvstrata import KVStrataConfig, TieredKVCache

    cache = TieredKVCache(KVStrataConfig.from_dict({"block_size": 4, "model": {"block_nbytes": 1024},
                                                  "gpu": {"num_blocks": 8, "device": "cpu"},
                                                  "cpu": {"capacity": 8192}, "ssd": {"capacity": 0}}))
    try:
        collector = KVStrataCollector(cache.stats, cache.lifecycle)
        for family in collector.collect():
            if isinstance(family, HistogramMetricFamily):
                exported.add(family.name + "_bucket")
            elif isinstance(family, CounterMetricFamily):
                exported.add(family.name + "_total")
    finally:
        cache.close()
    ours = {s for s in dashboard_series() if s.startswith("kvstrata:")}
    assert ours and not ours - exported, sorted(ours - exported)


def test_evictions_and_rejections_are_labelled_with_each_tiers_policy() -> None:
    from kvstrata import KVStrataConfig, TieredKVCache
    from kvstrata.core.metrics import KVStrataCollector

    cache = TieredKVCache(KVStrataConfig.from_dict({"block_size": 4, "model": {"block_nbytes": 1024},
                                                  "gpu": {"num_blocks": 8, "device": "cpu"},
                                                  "cpu": {"capacity": 8192, "eviction": "s3fifo"},
                                                  "ssd": {"capacity": 0}}))
    try:
        families = {f.name: f for f in KVStrataCollector(cache.stats, cache.lifecycle).collect()}
    finally:
        cache.close()
    evictions = {s.labels["tier"]: s.labels["eviction"] for s in families["kvstrata:evictions"].samples
                 if s.name.endswith("_total")}
    assert evictions["cpu"] == "s3fifo"
    assert all("admission" in s.labels for s in families["kvstrata:admissions_rejected"].samples)


def test_load_decisions_are_exported_per_tier_and_decision() -> None:
    from kvstrata import KVStrataConfig, TieredKVCache
    from kvstrata.core.costs import LoadCosts
    from kvstrata.core.metrics import KVStrataCollector

    costs = LoadCosts(("cpu", "ssd"), policy="measured", block_seconds={"ssd": 1.0}, token_seconds=1e-3)
    costs.count(["cpu", "ssd", "ssd"], costs.worth(["cpu", "ssd", "ssd"], 16))
    cache = TieredKVCache(KVStrataConfig.from_dict({"block_size": 4, "model": {"block_nbytes": 1024},
                                                  "gpu": {"num_blocks": 8, "device": "cpu"},
                                                  "cpu": {"capacity": 8192}, "ssd": {"capacity": 0}}))
    try:
        stats = lambda: {**cache.stats(), "load": {**costs.estimates(), "decisions": costs.decisions}}  # noqa: E731
        families = {f.name: f for f in KVStrataCollector(stats, cache.lifecycle).collect()}
    finally:
        cache.close()
    got = {(s.labels["tier"], s.labels["decision"]): s.value for s in families["kvstrata:load_decisions"].samples
           if s.name.endswith("_total")}
    assert got[("cpu", "loaded")] == 1 and got[("ssd", "recomputed")] == 2 and got[("ssd", "loaded")] == 0
