"""The shared tier in a replay: a model of its Redis/Valkey server, without bytes.

It models a server run with ``maxmemory`` and ``allkeys-lru``: an LRU of keys
holding ``remote.capacity`` bytes of blocks (the server's own per-key overhead
is not counted); a write (``SET NX``) of a key it holds, a probe and a fetch
all count as uses. Writes are write-behind in the plugin; here they land at
once. One replay (``remote.url`` and ``remote.capacity`` set) or several
replicas (``kvstrata bench --replicas``) share one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Sequence

from kvstrata.errors import ConfigError
from kvstrata.dataplane.executor import Lost, NullExecutor
from kvstrata.policy.plans import StorePlan
from kvstrata.policy.tiers import KNOWN

if TYPE_CHECKING:
    from kvstrata.config.schema import KVStrataConfig

__all__ = ["SharedTierModel", "SharedTierExecutor", "shared_capacity_bytes", "shared_capacity_blocks",
           "models_shared"]


def shared_capacity_bytes(cfg: "KVStrataConfig") -> int:
    """The bytes of blocks the modelled server holds: ``remote.capacity`` (0: not set)."""
    return cfg.remote.capacity or 0


def models_shared(cfg: "KVStrataConfig") -> bool:
    """Does one replay of ``cfg`` model the shared tier: the tier is declared (``remote.url``)
    and its server's size given (``remote.capacity``)."""
    return cfg.remote.enabled and shared_capacity_bytes(cfg) > 0


def shared_capacity_blocks(cfg: "KVStrataConfig") -> int:
    """Blocks of ``cfg``'s size that ``remote.capacity`` holds (at least one)."""
    capacity, nbytes = shared_capacity_bytes(cfg), cfg.block_nbytes()
    if capacity // nbytes < 1:
        raise ConfigError(f"remote.capacity: {capacity:,} bytes hold no block of {nbytes:,} bytes")
    return capacity // nbytes


class SharedTierModel:
    """The shared tier of a fleet, without bytes: an LRU of at most ``capacity`` keys."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: expected at least one block, got {capacity}")
        self.capacity = capacity
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self.counts = {"stored": 0, "present": 0, "evicted": 0, "fetched": 0}

    def __len__(self) -> int:
        return len(self._lru)

    def put_many(self, keys: Sequence[bytes]) -> None:
        """``SET key value NX`` for each key: a held key is only used (its value stays)."""
        lru = self._lru
        for key in keys:
            if key in lru:
                lru.move_to_end(key)
                self.counts["present"] += 1
            else:
                lru[key] = None
                self.counts["stored"] += 1
        over = len(lru) - self.capacity
        for _ in range(max(0, over)):
            lru.popitem(last=False)
        self.counts["evicted"] += max(0, over)

    def held_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the tier holds (probed and fetched: each is used)."""
        lru = self._lru
        n = 0
        for key in keys:
            if key not in lru:
                break
            lru.move_to_end(key)
            n += 1
        self.counts["fetched"] += n
        return n


class SharedTierExecutor(NullExecutor):
    """A replica's executor without bytes over a :class:`SharedTierModel`: stores the blocks plans
    send to the shared tier there, and probes it for what follows a local prefix."""

    def __init__(self, shared: SharedTierModel) -> None:
        super().__init__()
        self.server = shared

    def probe(self, keys: Sequence[bytes]) -> int:
        return self.server.held_prefix(keys) if keys else 0

    def store(self, plan: StorePlan) -> Lost:
        self.server.put_many([plan.keys[i] for t, idx in plan.writes.items() if KNOWN[t].shared for i in idx])
        return []
