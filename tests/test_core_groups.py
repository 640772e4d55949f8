"""The driver core holds a model's KV-cache groups always (a plain model: one full-attention
group), and a hit from the shared remote tier is decided (load or recompute) as a local one,
with groups too: over every group's blocks it needs, whole or not at all."""

from __future__ import annotations

from typing import Any

from kvstrata.core.costs import MEASURED, LoadCosts
from kvstrata.core.driver import DriverCore
from kvstrata.core.request import RequestState
from kvstrata.identity.groups import FULL, SLIDING, Group, KVGroups
from kvstrata.policy import FetchPlan, PolicySpec, TierPolicy

BS = 16
HYBRID = KVGroups([Group(FULL), Group(SLIDING, 40)], BS)  # a hit at n needs window blocks from (16n - 39) // 16


def measured(remote: float) -> LoadCosts:
    """A block costs 1-2 ms to load from CPU/SSD, ``remote`` seconds to fetch; 16 ms to compute."""
    costs = LoadCosts(("cpu", "ssd"), "remote", policy=MEASURED, margin=0.0, warmup=3)
    for n in (1, 4, 2, 8, 3):
        costs.load_done({"cpu": n}, n * 0.001)
        costs.load_done({"cpu": n, "ssd": 2 * n}, n * 0.001 + 2 * n * 0.002)
        costs.step_done(n * BS, n * BS * 0.001, BS)
        costs.fetch_done(n, n * remote)
    return costs


def core(groups: KVGroups | None, remote: float) -> DriverCore:
    return DriverCore(TierPolicy(PolicySpec(slab_slots=64, shared=True)), BS, groups, measured(remote))


class Server:
    """A synchronous driver's executor over a remote tier holding every key: a probe answers
    how many leading keys it holds (as :meth:`Executor.probe`), a fetch brings them all."""

    def __init__(self) -> None:
        self.fetched: list[bytes] = []

    def probe(self, keys: Any) -> int:
        return len(keys)

    def fetch(self, plan: FetchPlan) -> int:
        self.fetched += plan.keys
        return len(plan.keys)


def chain(n: int) -> list[bytes]:
    return [bytes([i]) * 32 for i in range(n)]


def test_a_plain_driver_core_holds_one_full_attention_group() -> None:
    c = DriverCore(TierPolicy(PolicySpec(slab_slots=8)), BS)
    assert c.groups.plain and len(c.groups) == 1 and c.groups.describe() == ""
    st = c.open(RequestState("a", chain(4)))
    assert c.all_group_keys(st, 1, 3) == chain(4)[1:3]


def test_a_grouped_remote_hit_is_decided_over_every_groups_blocks_it_needs() -> None:
    """6 blocks held remotely after nothing local: a hit at 6 needs full attention's 0..5 and
    the window's 3..5 (9 entries). Fetched at 1 s a block they cost more than computing 6
    blocks: none is fetched and all 9 are counted recomputed; at 0.1 ms a block all are."""
    slow = core(HYBRID, remote=1.0)
    st = slow.open(RequestState("a", chain(8)))
    assert slow.worth_fetching(st, 0, 0, 6) == 0
    assert slow.costs is not None and slow.costs.decisions["remote"] == {"loaded": 0, "recomputed": 9}
    fast = core(HYBRID, remote=0.0001)
    st = fast.open(RequestState("a", chain(8)))
    assert fast.worth_fetching(st, 0, 0, 6) == 6
    assert fast.costs is not None and fast.costs.decisions["remote"] == {"loaded": 9, "recomputed": 0}


def test_a_plain_remote_hit_is_cut_where_fetching_stops_paying() -> None:
    """One full-attention group: every prefix of a remote hit is a hit, decided block by block."""
    slow = core(None, remote=1.0)
    st = slow.open(RequestState("a", chain(8)))
    assert slow.worth_fetching(st, 0, 0, 6) == 0
    assert slow.costs is not None and slow.costs.decisions["remote"] == {"loaded": 0, "recomputed": 6}


def test_a_synchronous_driver_fetches_a_grouped_remote_hit_only_when_it_is_worth_it() -> None:
    """:meth:`DriverCore.lookup_now` with groups: the executor's probe answers a leading count
    of the keys probed (every group's, block by block); the hit is fetched and loaded whole
    when fetching pays, and neither probed further nor fetched when it does not."""
    fast, server = core(HYBRID, remote=0.0001), Server()
    st = fast.open(RequestState("a", chain(8)))
    assert fast.lookup_now(st, server, 0, 7) == 7  # type: ignore[arg-type]
    window = [st.group_key(1, i) for i in range(4, 7)]  # a hit at 7 needs window blocks 4..6
    assert sorted(server.fetched) == sorted(chain(7) + window)
    assert all(fast.policy.holds(k) == "cpu" for k in server.fetched)
    slow, server = core(HYBRID, remote=1.0), Server()
    st = slow.open(RequestState("a", chain(8)))
    assert slow.lookup_now(st, server, 0, 7) == 0  # type: ignore[arg-type]
    assert server.fetched == [] and slow.policy.holds(chain(1)[0]) is None


def test_a_probe_answer_of_leading_keys_gives_the_hit_every_group_serves() -> None:
    """A leading count of interleaved keys (block i of group g is key 2i + g): 9 keys hold
    full attention's blocks 0..4 and the window's 0..3, so a hit can end at 4 at most."""
    c = core(HYBRID, remote=0.0001)
    st = c.open(RequestState("a", chain(8)))
    assert c.probed(9, 0, 7, st) == 4
    assert c.probed(14, 0, 7, st) == 7
    assert core(None, remote=0.0001).probed(5, 2, 7) == 5
