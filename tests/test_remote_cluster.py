"""The remote tier on a Valkey cluster (``remote.cluster: true``): three real servers in
cluster mode on loopback, keys spread over their slots; round trips are exact, a
prefix stops at the first missing block wherever its keys live, and a node SIGKILLed
mid-run costs misses within the deadline, never an error."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

from kvstrata.config.remote import RemoteConfig
from kvstrata.tiers.remote import RemoteTier, key_prefix

sys.path.insert(0, str(Path(__file__).parent))
from valkey_server import ValkeyCluster  # noqa: E402

NB = 64 * 1024


def blocks(n: int) -> tuple[list[bytes], np.ndarray]:
    rng = np.random.default_rng(5)
    return [rng.bytes(32) for _ in range(n)], rng.integers(0, 256, (n, NB), dtype=np.uint8)


def test_cluster_round_trips_across_nodes_and_a_dead_node_costs_misses(tmp_path: Path) -> None:
    with ValkeyCluster(tmp_path) as cluster:
        cfg = RemoteConfig(url=cluster.url, cluster=True, timeout=0.5, connect_timeout=0.5)
        tier = RemoteTier(dataclasses.replace(cfg, compression="none"), key_prefix("fp-cluster"), NB)
        reader = RemoteTier(cfg, key_prefix("fp-cluster"), NB, writer=False)
        keys, rows = blocks(60)
        for k, r in zip(keys, rows):
            assert tier.put(k, r)
        assert tier.flush(10)
        spread = [n.client().dbsize() for n in cluster.nodes]
        assert sum(spread) == 60 and min(spread) > 0  # every node holds some of them
        out = np.zeros_like(rows)
        assert reader.probe(keys) == 60
        assert reader.get_into(keys, out) == 60 and np.array_equal(out, rows)
        gone = cluster.nodes[1].client()
        gone.flushall()  # the blocks on one node vanish: the prefix stops at the first of them
        first_gone = next(i for i, k in enumerate(keys) if not tier.client.exists(tier.prefix + k))
        assert reader.probe(keys) == first_gone
        cluster.nodes[2].kill()
        t0 = time.monotonic()
        got = reader.get_into(keys, out)
        assert got <= first_gone and time.monotonic() - t0 < 3.0  # misses within the deadline
        tier.close(), reader.close()


def test_a_dead_node_costs_only_the_keys_it_owns(tmp_path: Path) -> None:
    """Regression: one dead master made every pipeline fail, the breaker opened for the whole
    tier, and hits of keys on the live nodes fell to 0 for good."""
    with ValkeyCluster(tmp_path) as cluster:
        tier = RemoteTier(RemoteConfig(url=cluster.url, cluster=True, timeout=0.5, connect_timeout=0.3,
                                       compression="none"), key_prefix("fp-cluster"), NB)
        keys, rows = blocks(90)
        for k, r in zip(keys, rows):
            assert tier.put(k, r)
        assert tier.flush(10)
        dead = cluster.nodes[2]
        dead_port = dead.port
        owner = {k: tier.client.get_node_from_key(tier.key(k)).port for k in keys}
        live = [i for i, k in enumerate(keys) if owner[k] != dead_port]
        lost = [i for i, k in enumerate(keys) if owner[k] == dead_port]
        assert live and lost
        dead.kill()
        live_keys, out = [keys[i] for i in live], np.zeros((len(live), NB), dtype=np.uint8)
        for _ in range(5):  # past the breaker's threshold: the dead node's keys keep failing
            assert tier.probe([keys[i] for i in lost]) == 0
        assert tier.probe(live_keys) == len(live)
        assert tier.get_into(live_keys, out) == len(live) and np.array_equal(out, rows[live])
        assert tier.stats()["breaker"] == "closed"  # the tier's own breaker: the live nodes answer
        more_keys, more_rows = blocks(120)
        fresh = [(k, r) for k, r in zip(more_keys, more_rows)
                 if k not in owner and tier.client.get_node_from_key(tier.key(k)).port != dead_port][:10]
        for k, r in fresh:
            assert tier.put(k, r)
        assert tier.flush(10)
        got = np.zeros((len(fresh), NB), dtype=np.uint8)
        assert tier.get_into([k for k, _ in fresh], got) == len(fresh)  # writes to live nodes go on too
        tier.close()
