"""``kvstrata bench --replicas``: replicas of the same policy sharing a remote tier, routed
round robin or by prefix; exact hits on hand-made traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.bench.replay import ReplayError, replay
from kvstrata.bench.remote import SharedTierModel
from kvstrata.bench.replicas import replay_replicas, replicas_report, render_replicas
from kvstrata.trace.reader import TraceBuilder
from kvstrata.bench.workloads import generate
from kvstrata.cli.commands import main
from kvstrata.config.schema import KVStrataConfig


def cfg(tmp_path: Path, *, gpu: int = 100, cpu: int = 0, ssd: int = 0, remote: int | None = 64) -> KVStrataConfig:
    """Block size 4 tokens, 1 KiB per block; capacities in blocks."""
    return KVStrataConfig.from_dict({
        "block_size": 4, "model": {"block_nbytes": 1024}, "gpu": {"num_blocks": gpu},
        "cpu": {"capacity": cpu * 1024}, "ssd": {"path": str(tmp_path / "ssd"), "capacity": ssd * 1024},
        "remote": {"capacity": None if remote is None else remote * 1024}})


def trace(turns: list[tuple[float, list[int]]]):  # type: ignore[no-untyped-def]
    b = TraceBuilder("t", "mooncake", 4)
    for ts, ids in turns:
        b.add_ids(ts, ids, 4 * len(ids), 0)
    return b.build()


def hits(res, routing: str, shared: bool) -> list[dict[str, int]]:  # type: ignore[no-untyped-def]
    return [r.hit_blocks for r in res.fleet(routing, shared).results]


def test_shared_remote_is_an_lru_where_set_nx_and_reads_are_uses() -> None:
    tier = SharedTierModel(3)
    tier.put_many([b"a", b"b", b"c"])
    tier.put_many([b"a"])                      # SET NX of a held key: a use
    tier.put_many([b"d"])                      # evicts b, the least recently used
    assert tier.held_prefix([b"a", b"b", b"c"]) == 1
    assert tier.held_prefix([b"c", b"d", b"a"]) == 3
    tier.put_many([b"e"])                      # evicts c, the least recently read
    assert tier.held_prefix([b"c"]) == 0 and len(tier) == 3
    assert tier.counts == {"stored": 5, "present": 1, "evicted": 2, "fetched": 4}


def test_round_robin_turn_on_another_replica_is_served_by_the_shared_tier(tmp_path: Path) -> None:
    # round robin over 2: requests 0 and 2 to replica 0, 1 and 3 to replica 1; conversation
    # X's second turn (request 3) lands on replica 1, which never saw X
    t = trace([(0, [1, 2, 3]), (1, [7, 8]), (2, [9]), (3, [1, 2, 3, 4])])
    res = replay_replicas(t, cfg(tmp_path, cpu=10), 2, routings=["round_robin"])
    assert res.fleet("round_robin", False).sent == [2, 2]
    assert hits(res, "round_robin", False) == [{"gpu": 0, "cpu": 0, "ssd": 0}] * 2
    assert hits(res, "round_robin", True) == [{"gpu": 0, "cpu": 0, "ssd": 0, "remote": 0},
                                              {"gpu": 0, "cpu": 0, "ssd": 0, "remote": 3}]


def test_prefix_routing_sends_a_conversation_back_to_its_replica(tmp_path: Path) -> None:
    t = trace([(0, [1, 2, 3]), (1, [7, 8]), (2, [9]), (3, [1, 2, 3, 4]), (4, [7, 8, 5])])
    res = replay_replicas(t, cfg(tmp_path, gpu=100, cpu=10), 2, routings=["prefix"])
    fleet = res.fleet("prefix", False)
    # X to replica 0, Y to the one that took fewer (1), Z to 0; X's second turn back to 0
    # (3 GPU hits: its third request, within ceil(1.25 * 4 / 2) = 3), Y's to 1 (2 GPU hits)
    assert [r.hit_blocks["gpu"] for r in fleet.results] == [3, 2]
    assert sum(fleet.sent) == 5


def test_prefix_routing_bounds_the_load_of_a_shared_prefix(tmp_path: Path) -> None:
    # every request shares block 1 (a system prompt): without a bound all go to one replica
    t = trace([(float(i), [1, 100 + i]) for i in range(40)])
    res = replay_replicas(t, cfg(tmp_path, cpu=10), 4, routings=["prefix"])
    sent = res.fleet("prefix", False).sent
    assert sum(sent) == 40 and max(sent) <= 13  # ceil(1.25 * 40 / 4)


def test_one_replica_without_the_shared_tier_is_the_plain_replay(tmp_path: Path) -> None:
    t = generate("chat", 1, block_size=4, scale=0.2)
    config = cfg(tmp_path, gpu=4096, cpu=32, ssd=16)
    plain = replay(t, config)
    assert plain.hits > 0
    res = replay_replicas(t, config, 1)
    for routing in ("round_robin", "prefix"):
        assert hits(res, routing, False) == [plain.hit_blocks]


def test_one_replica_gets_back_from_the_shared_tier_what_dram_evicted(tmp_path: Path) -> None:
    # a 4-block pool holds one request, DRAM three blocks: when a conversation comes back,
    # both evicted it long ago; the shared tier still holds it
    t = trace([(0, [1, 2, 3]), (1, [11, 12, 13]), (2, [21, 22, 23]), (3, [1, 2, 3, 4]), (4, [11, 12, 13, 14])])
    config = cfg(tmp_path, gpu=4, cpu=3, remote=64)
    assert replay(t, config).hit_blocks == {"gpu": 0, "cpu": 0, "ssd": 0}
    res = replay_replicas(t, config, 1, routings=["round_robin"])
    assert hits(res, "round_robin", True) == [{"gpu": 0, "cpu": 0, "ssd": 0, "remote": 6}]
    report = replicas_report(res)
    assert report["fleets"][1]["hit_rate"]["remote"] == round(6 / 17, 4)
    assert "The shared tier adds +35.3% of hits with round robin routing" in render_replicas(report)


def test_one_replay_with_a_configured_remote_tier_models_it(tmp_path: Path) -> None:
    """``remote.url`` and ``remote.capacity`` set: a plain replay has the same shared tier
    as a fleet of one, and its report has a row for it."""
    t = trace([(0, [1, 2, 3]), (1, [11, 12, 13]), (2, [21, 22, 23]), (3, [1, 2, 3, 4]), (4, [11, 12, 13, 14])])
    config = KVStrataConfig.from_dict({**{"block_size": 4, "model": {"block_nbytes": 1024}},
                                     "gpu": {"num_blocks": 4}, "cpu": {"capacity": 3 * 1024},
                                     "ssd": {"capacity": 0},
                                     "remote": {"url": "redis://cache:6379/0", "capacity": 64 * 1024}})
    r = replay(t, config)
    assert r.hit_blocks == {"gpu": 0, "cpu": 0, "ssd": 0, "remote": 6}
    assert r.capacity_blocks["remote"] == 64 and r.hit_rate()["remote"] == 6 / 17
    unsized = KVStrataConfig.from_dict({**config.to_dict(), "remote": {"url": "redis://cache:6379/0"}})
    assert "remote" not in replay(t, unsized).hit_blocks  # the server's maxmemory is not known here


def test_replicas_need_the_shared_tiers_size(tmp_path: Path) -> None:
    with pytest.raises(ReplayError, match="--replicas: set remote.capacity"):
        replay_replicas(trace([(0, [1])]), cfg(tmp_path, cpu=10, remote=None), 2)
    with pytest.raises(ReplayError, match="--replicas: .*set cpu.capacity"):
        replay_replicas(trace([(0, [1])]), cfg(tmp_path, cpu=0), 2)


def test_cli_replicas(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--replicas", "3", "--scale", "0.1", "--set", "remote.capacity=64GiB"]) == 0
    out = capsys.readouterr().out
    assert "3 replicas" in out and "round robin" in out and "prefix-aware" in out
    assert main(["bench", "--replicas", "3", "--scale", "0.1"]) == 2
    assert "set remote.capacity" in capsys.readouterr().err
    assert main(["bench", "--replicas", "2", "--plot", str(tmp_path / "p.png"),
                 "--set", "remote.capacity=64GiB"]) == 2
    assert "--plot: not with --replicas" in capsys.readouterr().err
