"""The deployment builder: what every driver runs, built one way.

The library (:class:`~kvstrata.library.tiered.TieredKVCache`), the vLLM connector's halves, the
``kvstrata bench`` replay and its payload runs all get from here:

* the policy's spec: each tier's capacity in blocks by its kind's capacity rule
  (:mod:`kvstrata.tiers.kinds`), declared in order (:func:`~kvstrata.policy.tiers.declare`);
* the tiers' backends, each opened by its kind's factory for a rank (or the one process);
* the executor over them, each backend in the role its kind declares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from kvstrata.config.schema import KVStrataConfig
from kvstrata.errors import ConfigError
from kvstrata.policy.spec import PolicySpec
from kvstrata.policy.tiers import chain
from kvstrata.tiers.kinds import Opening, TierKind, kind_of, kinds

if TYPE_CHECKING:
    from kvstrata.dataplane.device_rows import DeviceRows
    from kvstrata.dataplane.executor import Executor
    from kvstrata.identity.fingerprint import Fingerprint
    from kvstrata.identity.ranks import Rank

__all__ = ["policy_spec", "capacities", "Backends", "open_backends", "executor_over"]


def capacities(config: KVStrataConfig, block_nbytes: int) -> dict[str, int | None]:
    """Blocks each registered tier kind holds under ``config`` (None: not enabled); a
    ``tiers.<name>`` section of a kind that is not registered is a :class:`ConfigError`."""
    if isinstance(block_nbytes, bool) or not isinstance(block_nbytes, int) or block_nbytes < 1:
        raise ConfigError(f"block_nbytes: expected a positive integer, got {block_nbytes!r}")
    registered = kinds()
    for name in config.tiers.names():  # a plug-in section no registered kind claims
        if name not in registered:
            raise ConfigError(f"tiers.{name}: no tier kind named {name!r} is registered "
                              f"(registered: {', '.join(registered)})")
    return {name: kind.capacity(config, block_nbytes) for name, kind in registered.items()}


def policy_spec(config: KVStrataConfig, *, block_nbytes: int, gpu_blocks: int) -> PolicySpec:
    """The spec a deployment of ``config`` runs, with blocks of ``block_nbytes`` bytes and a
    device pool of ``gpu_blocks`` blocks: every registered kind the config enables, declared
    by its kind in chain order (:func:`~kvstrata.policy.tiers.chain`)."""
    caps = capacities(config, block_nbytes)
    declared = [kind.declare(config, caps[name] or 0) for name, kind in kinds().items() if caps[name] is not None]
    tiers = chain(declared, write_through=config.spill.write_through)
    return PolicySpec.from_tiers(config, tiers, gpu_blocks=gpu_blocks)


@dataclass
class Backends:
    """The backends a deployment opened, by tier name, in the spec's order."""

    by_name: dict[str, Any] = field(default_factory=dict)
    kinds: dict[str, TierKind] = field(default_factory=dict)

    def role(self, role: str) -> Any:
        """The backend of the (first) tier in ``role`` (``slab``, ``store``, ``shared``), or None."""
        return next((self.by_name[n] for n, k in self.kinds.items() if k.role == role), None)

    def close(self) -> None:
        """Close every backend that can be closed, the last opened first."""
        for backend in reversed(list(self.by_name.values())):
            close = getattr(backend, "close", None)
            if close is not None:
                close()


def open_backends(config: KVStrataConfig, spec: PolicySpec, fingerprint: "Fingerprint | None", block_nbytes: int, *,
                  rank: "Rank | None" = None, options: Mapping[str, Mapping[str, Any]] | None = None) -> Backends:
    """Open the backend of every tier ``spec`` declares, by its kind's factory. ``options``:
    per tier name, what this driver asks of it (see each kind's factory). A failure closes
    what was opened before it, and raises."""
    assert spec.tiers is not None
    out = Backends()
    try:
        for tier in spec.tiers:
            kind = kind_of(tier.name)
            opening = Opening(config, fingerprint, block_nbytes, tier.capacity, rank,
                              dict((options or {}).get(tier.name, {})))
            out.kinds[tier.name] = kind
            out.by_name[tier.name] = kind.open(opening)
    except BaseException:
        out.close()
        raise
    return out


def executor_over(device: "DeviceRows | None", backends: Backends) -> "Executor":
    """The executor that runs plans against ``device`` and ``backends``, each in its kind's role."""
    from kvstrata.dataplane.executor import Executor

    return Executor(device, backends.by_name)
