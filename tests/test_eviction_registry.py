"""Eviction orders are registered classes behind one interface (kvstrata.policy.orders): the
registry is the one table of their names, which the config's check, make_order and the real
TierPolicy all read."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections import OrderedDict
from typing import Iterator

import pytest

from kvstrata import KVStrataConfig
from kvstrata.core.deployment import policy_spec
from kvstrata.errors import ConfigError
from kvstrata.policy import TierPolicy
from kvstrata.policy.cost_eviction import CostOrder
from kvstrata.policy.eviction import ARCOrder, LRUOrder, S3FIFOOrder, make_order
from kvstrata.policy.orders import EvictionOrder, OrderContext, order_names, register_order, unregister_order
from kvstrata.policy.slot_index import SlotIndex
from kvstrata.system.values import EVICTION_ORDERS, EVICTIONS

K = [hashlib.sha256(b"%d" % i).digest() for i in range(16)]
NB = 4096


class MRUOrder(EvictionOrder):
    """Most recently used first: the opposite of LRU (a test-only order)."""

    name = "test-mru"
    contexts: list[OrderContext] = []

    def __init__(self) -> None:
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    @classmethod
    def create(cls, num_slots: int, value: str, context: OrderContext) -> "MRUOrder":
        cls.contexts.append(context)
        return cls()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[bytes]:
        return iter(reversed(list(self._keys)))

    def add(self, key: bytes) -> None:
        self._keys[key] = None

    def add_many(self, keys: list[bytes]) -> None:
        for key in keys:
            self.add(key)

    def access(self, key: bytes) -> None:
        self._keys.move_to_end(key)

    def hold(self, key: bytes) -> None:
        del self._keys[key]

    def release(self, key: bytes, use: bool = True) -> None:
        self._keys[key] = None

    def rename_held(self, key: bytes, new_key: bytes) -> None:
        pass

    def rename(self, key: bytes, new_key: bytes) -> None:
        del self._keys[key]
        self._keys[new_key] = None

    def discard(self, key: bytes) -> None:
        del self._keys[key]

    def evict(self, incoming: bytes | None = None) -> bytes | None:
        return self._keys.popitem(last=True)[0] if self._keys else None


@pytest.fixture
def mru() -> Iterator[type[MRUOrder]]:
    MRUOrder.contexts.clear()
    register_order(MRUOrder)
    yield MRUOrder
    unregister_order(MRUOrder.name)


def policy(overrides: dict[str, object]) -> TierPolicy:
    cfg = KVStrataConfig.from_dict({}, {"cpu.capacity": NB * 4, "ssd.capacity": NB * 64, "ssd.path": "/x",
                                        "spill.write_through": False, **overrides})
    return TierPolicy(policy_spec(cfg, block_nbytes=NB, gpu_blocks=8))


def store(p: TierPolicy, keys: list[bytes]) -> None:
    p.complete_store(p.prepare_store(list(range(len(keys))), keys, "computed"))


def test_a_registered_order_runs_a_tier_by_its_name(mru: type[MRUOrder]) -> None:
    """The DRAM tier under the test's order evicts what it says: the most recently stored
    block, which cascades to the SSD tier (LRU, the default, evicts the oldest)."""
    p = policy({"cpu.eviction": mru.name})
    assert isinstance(p.slab._lru, MRUOrder)  # noqa: SLF001
    assert mru.contexts == [p.order_context]  # what it may weigh blocks by: the policy's, through create
    store(p, K[:4])
    p.slab.touch(K[1])                          # now the most recently used
    store(p, K[4:5])
    assert K[1] in p.store and K[1] not in p.slab  # evicted to place K[4], and cascaded below
    assert all(k in p.slab for k in (K[0], K[2], K[3], K[4]))
    p.check()
    lru = policy({})
    store(lru, K[:4])
    lru.slab.touch(K[1])
    store(lru, K[4:5])
    assert K[0] in lru.store and K[1] in lru.slab


def test_a_batch_never_evicts_its_own_blocks_under_a_registered_order(mru: type[MRUOrder]) -> None:
    """allocate_many places each key in turn and never evicts one it placed for a later one:
    under an order whose adds are not behind every entry (``recent_last`` False) the batch's
    keys are held out of its reach until the call ends."""
    index = SlotIndex(3, mru.name)
    for key in K[:3]:
        index.allocate(key)
    slots, evicted = index.allocate_many([K[0], K[3], K[4]])  # K[0] present: used and held
    assert None not in slots and [k for k, _ in evicted] == [K[2], K[1]]
    assert all(k in index for k in (K[0], K[3], K[4]))
    index.check()


def test_an_unknown_order_is_a_config_error_naming_every_registered_one(mru: type[MRUOrder]) -> None:
    choices = "lru, s3fifo, arc, cost, test-mru"
    with pytest.raises(ConfigError, match=rf"^cpu\.eviction: expected one of {choices}; got 'mru'$"):
        KVStrataConfig.from_dict({}, {"cpu.eviction": "mru"})
    with pytest.raises(ConfigError, match=rf"^ssd\.eviction: expected one of {choices}; got 'fifo'$"):
        make_order("fifo", 4, "ssd.eviction")
    unregister_order(mru.name)
    with pytest.raises(ConfigError, match=r"^cpu\.eviction: expected one of lru, s3fifo, arc, cost; got 'test-mru'$"):
        KVStrataConfig.from_dict({}, {"cpu.eviction": "test-mru"})


def test_two_orders_of_one_name_are_a_config_error(mru: type[MRUOrder]) -> None:
    class Another(MRUOrder):
        pass

    class Impostor(MRUOrder):
        name = "lru"

    with pytest.raises(ConfigError, match=r"^eviction: two orders are named 'test-mru': MRUOrder and .*Another$"):
        register_order(Another)
    with pytest.raises(ConfigError, match=r"^eviction: two orders are named 'lru': LRUOrder and .*Impostor$"):
        register_order(Impostor)
    assert EVICTION_ORDERS[mru.name] is MRUOrder and EVICTION_ORDERS["lru"] is LRUOrder
    register_order(MRUOrder)  # the same class again: nothing changes
    assert order_names() == [*EVICTIONS, mru.name]


def test_an_order_without_a_name_is_refused() -> None:
    class Nameless(MRUOrder):
        name = "cost:2"

    with pytest.raises(ConfigError, match=r"^eviction: the order .*Nameless needs a name"):
        register_order(Nameless)
    assert "cost:2" not in EVICTION_ORDERS


def test_the_shipped_orders_are_registered_under_their_names() -> None:
    assert {n: EVICTION_ORDERS[n] for n in EVICTIONS} == {"lru": LRUOrder, "s3fifo": S3FIFOOrder, "arc": ARCOrder,
                                                          "cost": CostOrder}
    for name, cls in EVICTION_ORDERS.items():
        assert issubclass(cls, EvictionOrder) and cls.name == name
    assert [type(make_order(n, 8)) for n in EVICTIONS] == [LRUOrder, S3FIFOOrder, ARCOrder, CostOrder]


@pytest.mark.parametrize(("value", "alpha"), [("cost", 0.5), ("cost:0.25", 0.25), (" cost:2 ", 2.0), ("cost:0", 0.0)])
def test_every_cost_spelling_still_works(value: str, alpha: float) -> None:
    order = make_order(value, 8, "ssd.eviction")
    assert isinstance(order, CostOrder) and order.alpha == alpha
    assert KVStrataConfig.from_dict({}, {"ssd.eviction": value}).ssd.eviction == value.strip()


def test_only_an_order_that_weighs_reaches_makes_the_driver_note_prompts() -> None:
    assert not policy({}).order_context.learning and policy({}).order_context.book is None
    costed = policy({"ssd.eviction": "cost:1"})
    assert costed.order_context.learning
    assert costed.store._lru.positions is costed.order_context.book  # noqa: SLF001


def test_a_config_is_checked_without_importing_the_policy() -> None:
    """The shipped orders' names are declared below the config, so a config is checked (and
    an unknown order refused with every choice) in a process that never imports the policy."""
    code = """
import json, sys
from kvstrata.config.schema import KVStrataConfig
from kvstrata.errors import ConfigError
ok = [KVStrataConfig.from_dict({}, {"ssd.eviction": v}).ssd.eviction for v in ("s3fifo", "arc", "cost", "cost:0.5")]
try:
    KVStrataConfig.from_dict({}, {"ssd.eviction": "mru"})
    error = None
except ConfigError as exc:
    error = str(exc)
print(json.dumps([ok, error, any(m.startswith("kvstrata.policy") for m in sys.modules)]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    ok, error, policy_loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert ok == ["s3fifo", "arc", "cost", "cost:0.5"] and not policy_loaded
    assert error == "ssd.eviction: expected one of lru, s3fifo, arc, cost; got 'mru'"
