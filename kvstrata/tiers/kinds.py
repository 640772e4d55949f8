"""Tier kinds: what a deployment needs to run each kind of tier below the device, registered once.

A kind registers, in one call to :func:`register`:

* its declaration's defaults (a :class:`~kvstrata.policy.tiers.Tier`: its name, its role
  (slab, store or shared), medium, labels), which the policy places blocks by, and its
  ``position`` in the chain from the device down (the built-in kinds: ``cpu`` 100, ``ssd``
  300, ``remote`` 900; a tier between DRAM and SSD takes a number between);
* ``configure``: its declaration under a config, with its capacity (the section's eviction
  order and admission; by default the defaults with the capacity);
* the config section that configures it (errors name its keys);
* its capacity rule: the blocks it holds under that section, for blocks of a given size
  (None: the section does not enable it);
* a factory that opens its backend for one :class:`Opening` (a rank of an engine, or a single
  process), and the backend's class;
* optionally ``metrics``: its backend's own Prometheus families, from the ``stats()`` a driver
  reports under the tier's name (the remote tier's operations and breaker);
* optionally ``commands``: its operator commands, added to the ``kvstrata`` command's
  subcommands (``kvstrata ssd``, ``kvstrata remote``);
* its executor half: the methods the executor calls on a backend of its role (checked on the
  class when the kind registers, so a kind that lacks one is refused at start, not at the first
  copy).

The built-in kinds register in :mod:`kvstrata.tiers.dram` (``cpu``), :mod:`kvstrata.tiers.ssd.kind`
(``ssd``) and :mod:`kvstrata.tiers.remote.kind` (``remote``); :func:`kinds` loads them.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from kvstrata.errors import ConfigError
from kvstrata.policy.tiers import KNOWN, Tier, declare_kind, forget_kind

if TYPE_CHECKING:
    from kvstrata.config.schema import KVStrataConfig
    from kvstrata.identity.fingerprint import Fingerprint
    from kvstrata.identity.ranks import Rank

__all__ = ["Opening", "TierKind", "register", "unregister", "kinds", "kind_of", "HALVES", "role_of"]

#: The executor half of each role: what the executor and the copier call on a backend.
HALVES: dict[str, tuple[str, ...]] = {
    "slab": ("read", "write", "holds", "view", "forget", "forget_all"),
    "store": ("put", "get_into", "discard_many", "touch_many", "take_lost", "flush", "recovering", "wait_ready",
              "keys", "close"),
    "shared": ("put", "get_into", "probe", "close"),
}
#: The entry-point group under which installed packages name the modules that register their kinds.
ENTRY_POINTS = "kvstrata.tiers"
#: The modules whose import registers the built-in kinds.
BUILTIN = ("kvstrata.tiers.dram", "kvstrata.tiers.ssd.kind", "kvstrata.tiers.remote.kind")


def role_of(tier: Tier) -> str:
    """``slab``, ``store`` or ``shared``: which executor half a tier's backend implements."""
    return "shared" if tier.shared else "slab" if tier.slab else "store"


@dataclass(frozen=True)
class Opening:
    """What a kind's factory opens a backend for: a deployment of ``config`` whose blocks are
    ``block_nbytes`` bytes and compatible with ``fingerprint`` (None: ``options["tier_id"]`` names them), holding ``capacity`` blocks there
    (what the policy places), as ``rank`` of an engine (None: one process holds every block).
    ``options``: what one driver asks of a role (a remote tier's ``writer``, ``own_generation``)."""

    config: "KVStrataConfig"
    fingerprint: "Fingerprint | None"
    block_nbytes: int
    capacity: int
    rank: "Rank | None" = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def tier_id(self) -> str:
        """The identity the backend keys its blocks under: ``options["tier_id"]`` when given, else
        a rank's own, or the process's."""
        if "tier_id" in self.options:
            return str(self.options["tier_id"])
        assert self.fingerprint is not None, "a tier opened without a fingerprint needs options['tier_id']"
        return self.rank.tier_id(self.fingerprint) if self.rank is not None else self.fingerprint.tier_id()


@dataclass(frozen=True)
class TierKind:
    """One kind of tier (see the module docstring)."""

    declaration: Tier
    section: str
    capacity: Callable[["KVStrataConfig", int], "int | None"]
    open: Callable[[Opening], Any]
    backend: type
    position: int = 500
    configure: "Callable[[KVStrataConfig, int], Tier] | None" = None
    metrics: "Callable[[Mapping[str, Any]], Iterable[Any]] | None" = None
    commands: "Callable[[Any], None] | None" = None

    def declare(self, config: "KVStrataConfig", capacity: int) -> Tier:
        """This kind's declaration under ``config``, holding ``capacity`` blocks."""
        if self.configure is None:
            return dataclasses.replace(self.declaration, capacity=capacity)
        return self.configure(config, capacity)

    @property
    def name(self) -> str:
        return self.declaration.name

    @property
    def role(self) -> str:
        return role_of(self.declaration)


_KINDS: dict[str, TierKind] = {}


def register(kind: TierKind) -> TierKind:
    """Make ``kind`` known to deployments (its declaration to the policy too). A
    :class:`ConfigError` names what does not make sense: a second kind of one name, a backend
    without its role's executor half, a factory or capacity rule that is not callable."""
    if not isinstance(kind, TierKind) or not isinstance(kind.declaration, Tier):
        raise ConfigError(f"tiers: expected a TierKind with a Tier declaration, got {type(kind).__name__}")
    where = f"tiers.{kind.name}"
    if kind.name in _KINDS:
        raise ConfigError(f"{where}: a tier kind named {kind.name!r} is registered twice "
                          f"({_KINDS[kind.name].backend.__qualname__} and {kind.backend.__qualname__})")
    for what in ("capacity", "open", *(w for w in ("configure", "metrics", "commands") if getattr(kind, w) is not None)):
        if not callable(getattr(kind, what)):
            raise ConfigError(f"{where}.{what}: expected a callable, got {type(getattr(kind, what)).__name__}")
    missing = [m for m in HALVES[kind.role] if not callable(getattr(kind.backend, m, None))]
    if missing:
        raise ConfigError(f"{where}: the backend {kind.backend.__qualname__} lacks the {kind.role} tier's executor "
                          f"half: {', '.join(missing)}")
    declare_kind(kind.declaration)
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Forget a kind registered by :func:`register` (a test's own kind, once it is done)."""
    if _KINDS.pop(name, None) is not None:
        forget_kind(name)


def kinds() -> dict[str, TierKind]:
    """Every registered kind, in chain order from the device down (by ``position``; the
    built-in ones, and those installed packages declare, are imported on first use)."""
    for module in BUILTIN:
        importlib.import_module(module)
    if not _PLUGINS_LOADED:
        _load_plugins()
    return dict(sorted(_KINDS.items(), key=lambda item: item[1].position))


_PLUGINS_LOADED: list[bool] = []


def _load_plugins() -> None:
    """Import the modules installed packages declare under the ``kvstrata.tiers`` entry-point
    group (their import registers their kinds), once per process: every process of an engine
    (a vLLM worker too) then knows the same kinds. One that fails to import is a
    :class:`ConfigError` naming it."""
    from importlib.metadata import entry_points

    _PLUGINS_LOADED.append(True)
    for point in entry_points(group=ENTRY_POINTS):
        try:
            point.load()
        except Exception as exc:
            raise ConfigError(f"tiers: the tier kind plug-in {point.name!r} ({point.value}) failed to load: "
                              f"{type(exc).__name__}: {exc}") from None


def kind_of(name: str) -> TierKind:
    """The kind named ``name``; a :class:`ConfigError` naming the registered ones otherwise."""
    found = kinds().get(name)
    if found is None:
        raise ConfigError(f"tiers: no tier kind named {name!r} is registered "
                          f"(registered: {', '.join(kinds()) or 'none'})")
    return found


def builtin_declaration(name: str) -> Tier:
    """The policy's default declaration of a built-in kind (its name, role and labels)."""
    return KNOWN[name]
