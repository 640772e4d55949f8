"""The tiers below the device, declared once each, in order from the device down.

This module is the one place that names tiers. Statistics, metrics, KV-cache
events, the bench report and plans name a tier by its declaration's ``name``
and iterate a deployment's :class:`TierList`; nothing else compares a tier's
name with a string it spells itself.

A declaration says what differs between tiers:

* ``name``: how statistics, metrics, events and plans name it;
* ``medium``: the medium vLLM's KV-cache events give its blocks (None: it
  announces nothing; a shared tier says nothing about where to route);
* ``capacity``: blocks it holds at most (0: none; a shared tier's server
  evicts on its own, so it has none here);
* ``shared``: other replicas write to it and read from it (it needs a server);
* ``slab``: its blocks sit in slots of pinned host memory that copies to and from
  the device address directly (promotions and remote fetches land there);
* ``cascade``: the tier its evicted blocks go down to (None: they are dropped);
* ``admission``: what it takes of the blocks offered to it: ``always``, or
  ``second_hit`` (a block the second time it is offered or hit above it within
  the last ``ghost_keys`` keys seen once, :class:`~kvstrata.policy.ghost.Ghost`);
* ``eviction``: which unpinned block leaves when it needs room (``lru``,
  ``s3fifo``, ``arc``, ``cost[:<alpha>]``: :mod:`kvstrata.policy.eviction`);
* ``key``: the config section that declares it (errors name its keys);
* ``label``, ``hint``, ``hit_source``: how reports name it, what an operator
  raises to grow it, and vLLM's ``CacheHitSource`` member a hit from it is.

:func:`declare` builds a deployment's list from the tier sizes; :class:`TierList`
checks that the declarations make sense together.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Iterator

from kvstrata.errors import ConfigError
from kvstrata.system.values import ALWAYS, LRU, SECOND_HIT, TIER_ADMISSIONS, check_eviction

__all__ = ["ALWAYS", "SECOND_HIT", "GPU", "CPU", "SSD", "REMOTE", "LOWER", "SHARED", "PERSISTENT", "Tier", "TierList", "KNOWN", "declare", "chain", "describe_tiers", "declare_kind", "forget_kind"]

GPU = "gpu"  # the device pool (owned by the driver, not declared here)
CPU = "cpu"
SSD = "ssd"
REMOTE = "remote"


@dataclass(frozen=True)
class Tier:
    """One tier below the device (see the module docstring)."""

    name: str
    medium: str | None = None
    capacity: int = 0
    shared: bool = False
    slab: bool = False
    cascade: str | None = None
    server: str | None = None
    admission: str = ALWAYS
    ghost_keys: int = 0
    eviction: str = LRU
    key: str = ""
    label: str = ""
    hint: str = ""
    hit_source: str = "EXTERNAL_UNSPECIFIED"

    def where(self) -> str:
        """The config section errors about this tier name."""
        return self.key or self.name


#: Every tier kind this build runs, in order from the device down: a deployment's
#: declarations are these with their capacity, cascade and server filled in.
KNOWN: dict[str, Tier] = {t.name: t for t in (
    Tier(CPU, medium="CPU", slab=True, key="cpu", label="CPU", hint="raise cpu.capacity", hit_source="HOST"),
    Tier(SSD, medium="STORAGE", key="ssd", label="SSD", hint="raise ssd.capacity", hit_source="DISK"),
    Tier(REMOTE, shared=True, key="remote", label="remote", hint="raise the server's maxmemory"),
)}
_BUILTIN = frozenset(KNOWN)
LOWER = tuple(n for n, t in KNOWN.items() if not t.shared)  # the local kinds, as statistics name them
SHARED = tuple(n for n, t in KNOWN.items() if t.shared)
PERSISTENT = tuple(n for n, t in KNOWN.items() if not t.shared and not t.slab)  # records on a device that persists


def declare_kind(tier: Tier) -> None:
    """Make a tier kind's declaration known (:func:`kvstrata.tiers.kinds.register` calls this):
    deployments may then declare tiers of it. A second, different declaration of one name is a
    :class:`ConfigError`."""
    known = KNOWN.get(tier.name)
    if known is not None and known != tier:
        raise ConfigError(f"tiers.{tier.name}: a tier kind named {tier.name!r} is declared twice")
    KNOWN[tier.name] = tier


def forget_kind(name: str) -> None:
    """Forget a kind :func:`declare_kind` added (never a built-in one)."""
    if name not in _BUILTIN:
        KNOWN.pop(name, None)


@dataclass(frozen=True)
class TierList:
    """A deployment's tiers below the device, in order (checked on construction)."""

    tiers: tuple[Tier, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiers", tuple(self.tiers))
        _check(self.tiers)

    def __iter__(self) -> Iterator[Tier]:
        return iter(self.tiers)

    def __len__(self) -> int:
        return len(self.tiers)

    def __contains__(self, name: object) -> bool:
        return any(t.name == name for t in self.tiers)

    def __getitem__(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tiers)

    @property
    def local(self) -> tuple[Tier, ...]:
        """The tiers this replica holds (placed by the policy), in order."""
        return tuple(t for t in self.tiers if not t.shared)

    @property
    def shared(self) -> tuple[Tier, ...]:
        return tuple(t for t in self.tiers if t.shared)

    def slab(self) -> Tier | None:
        """The local tier whose slots the device copies to and from directly (None: none)."""
        return next((t for t in self.local if t.slab), None)

    def store(self) -> Tier | None:
        """The persistent local tier (the last key-addressed one, read through a staging
        buffer), None when there is none."""
        return next((t for t in reversed(self.local) if not t.slab), None)

    def capacity(self) -> dict[str, int]:
        """Blocks each local tier holds at most."""
        return {t.name: t.capacity for t in self.local}

    def with_shared(self, server: str | None) -> "TierList":
        """These local tiers with the shared tier on ``server`` (None: without one)."""
        shared = (dataclasses.replace(KNOWN[REMOTE], server=server),) if server else ()
        return TierList((*self.local, *shared))


def chain(declared: Iterable[Tier], *, write_through: bool = True) -> TierList:
    """The tiers of a deployment from their declarations, in order from the device down: each
    local tier cascades its evicted blocks into the next one, except into the persistent (last)
    tier when every stored block is written through to it already. A local tier that holds
    no block is left out unless a tier cascades into it (then :class:`TierList` refuses the
    declarations, naming its capacity)."""
    declared = list(declared)
    local = [t for t in declared if not t.shared]
    out: list[Tier] = []
    for i, t in enumerate(local):
        below = local[i + 1] if i + 1 < len(local) else None
        into = below is not None and not (write_through and below is local[-1] and not below.slab)
        if t.capacity or (out and out[-1].cascade == t.name):
            out.append(dataclasses.replace(t, cascade=below.name if into and below is not None else None))
    return TierList((*out, *(t for t in declared if t.shared)))


def declare(cpu_blocks: int, ssd_blocks: int | None, *, write_through: bool = True,
            remote_server: str | None = None, ssd_admission: tuple[str, int] = (ALWAYS, 0),
            remote_admission: tuple[str, int] = (ALWAYS, 0), cpu_eviction: str = LRU,
            ssd_eviction: str = LRU) -> TierList:
    """The built-in tiers of a deployment with these sizes (:func:`chain` over them). No CPU
    tier when ``cpu_blocks`` is 0; no SSD tier when ``ssd_blocks`` is None (not enabled); 0: enabled,
    holding no block, which is an error when the CPU tier cascades into it. A remote tier is
    declared when it has a server. ``*_admission``: ``(admission, ghost_keys)`` of that tier."""
    tiers = []
    if cpu_blocks:
        tiers.append(dataclasses.replace(KNOWN[CPU], capacity=cpu_blocks, eviction=cpu_eviction))
    if ssd_blocks is not None:
        tiers.append(dataclasses.replace(KNOWN[SSD], capacity=ssd_blocks, admission=ssd_admission[0],
                                         ghost_keys=ssd_admission[1], eviction=ssd_eviction))
    if remote_server is not None:
        tiers.append(dataclasses.replace(KNOWN[REMOTE], server=remote_server, admission=remote_admission[0],
                                         ghost_keys=remote_admission[1]))
    return chain(tiers, write_through=write_through)


def describe_tiers(tiers: Iterable[Tier], held: dict[str, int] | None = None) -> str:
    """One line for logs: each tier, its size and (``held``) what it holds now."""
    parts = []
    for t in tiers:
        if t.shared:
            parts.append(f"{t.label} tier on {t.server}")
        else:
            now = f" ({held.get(t.name, 0)} held)" if held is not None else ""
            parts.append(f"{t.capacity} {t.label} blocks{now}")
    return ", ".join(parts) or "no tier below the device"


def _check(tiers: tuple[Tier, ...]) -> None:
    """ConfigError, naming the key, for declarations that make no sense together."""
    seen: dict[str, int] = {}
    for i, t in enumerate(tiers):
        if not isinstance(t, Tier):
            raise ConfigError(f"tiers[{i}]: expected a tier declaration, got {type(t).__name__}")
        kind = KNOWN.get(t.name)
        if kind is None:
            raise ConfigError(f"{t.where()}: no executor runs a tier named {t.name!r} "
                              f"(this build runs {', '.join(KNOWN)})")
        if (t.slab, t.shared) != (kind.slab, kind.shared):
            raise ConfigError(f"{t.where()}: the {t.name!r} tier is {_role(kind)}, not {_role(t)}")
        if t.name in seen:
            raise ConfigError(f"{t.where()}: a tier named {t.name!r} is declared twice")
        seen[t.name] = i
        if isinstance(t.capacity, bool) or not isinstance(t.capacity, int) or t.capacity < 0:
            raise ConfigError(f"{t.where()}.capacity: expected a non-negative number of blocks, got {t.capacity!r}")
        if t.shared and not t.server:
            raise ConfigError(f"{t.where()}.url: the shared tier {t.name!r} has no server")
        _check_admission(t)
        if t.shared and t.capacity:
            raise ConfigError(f"{t.where()}.capacity: a shared tier's server evicts on its own; "
                              "it holds no blocks here")
    by_name = {t.name: t for t in tiers}
    for t in tiers:
        _check_cascade(t, by_name, seen)
    if any(t.shared for t in tiers):
        slab = next((t for t in tiers if t.slab and not t.shared), None)
        if slab is None or not slab.capacity:
            where = slab.where() if slab is not None else KNOWN[CPU].key
            raise ConfigError(f"{where}.capacity: the shared tier fetches blocks into this tier's slots before "
                              "they are served, and it holds no block")


def _check_cascade(t: Tier, by_name: dict[str, Tier], order: dict[str, int]) -> None:
    if t.cascade is None:
        return
    path, cur = [t.name], t
    while cur.cascade is not None:
        nxt = by_name.get(cur.cascade)
        if nxt is None:
            raise ConfigError(f"{cur.where()}.cascade: no tier named {cur.cascade!r} is declared "
                              f"(declared: {', '.join(by_name) or 'none'})")
        path.append(nxt.name)
        if nxt.name == t.name:
            raise ConfigError(f"{t.where()}.cascade: the cascade {' -> '.join(path)} is a cycle")
        if nxt.name in path[:-1]:
            return  # a cycle further down: reported for a tier on it
        cur = nxt
    target = by_name[t.cascade]
    if target.shared:
        raise ConfigError(f"{t.where()}.cascade: {target.name!r} is shared; evicted blocks cascade "
                          "only into a local tier")
    if order[target.name] < order[t.name]:
        raise ConfigError(f"{t.where()}.cascade: {target.name!r} is above {t.name!r}; evicted blocks "
                          "cascade down")
    if not target.capacity:
        raise ConfigError(f"{target.where()}.capacity: {t.name!r} cascades its evicted blocks into "
                          f"{target.name!r}, which holds no block")


def _check_admission(t: Tier) -> None:
    check_eviction(t.eviction, f"{t.where()}.eviction")
    if t.shared and t.eviction != LRU:
        raise ConfigError(f"{t.where()}.eviction: a shared tier's server evicts on its own (maxmemory-policy)")
    if t.admission not in TIER_ADMISSIONS:
        raise ConfigError(f"{t.where()}.admission: expected one of {', '.join(TIER_ADMISSIONS)}; got {t.admission!r}")
    if t.admission == SECOND_HIT and t.slab:
        raise ConfigError(f"{t.where()}.admission: the {t.name!r} tier takes every block it is offered "
                          f"(promotions and fetches land in it); {SECOND_HIT} is for the tiers below it")
    if t.admission == SECOND_HIT and (isinstance(t.ghost_keys, bool) or not isinstance(t.ghost_keys, int)
                                      or t.ghost_keys < 1):
        raise ConfigError(f"{t.where()}.ghost_keys: {SECOND_HIT} remembers the keys seen once in a window of "
                          f"at least 1 key; got {t.ghost_keys!r}")


def _role(t: Tier) -> str:
    return "shared" if t.shared else "a slab of host memory" if t.slab else "a persistent store"
