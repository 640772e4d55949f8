"""The remote tier as a tier kind: a shared server, enabled by ``remote.url``, holding no block
here (its server evicts on its own), opened for one rank's shard of the blocks."""

from __future__ import annotations

import dataclasses

from kvstrata.config.credentials import redact_url
from kvstrata.config.schema import KVStrataConfig
from kvstrata.policy.spec import ghost_keys
from kvstrata.policy.tiers import KNOWN, REMOTE, Tier
from kvstrata.tiers.kinds import Opening, TierKind, register
from kvstrata.tiers.remote.commands import add_commands
from kvstrata.tiers.remote.metrics import families
from kvstrata.tiers.remote.tier import RemoteTier

__all__ = ["remote_capacity", "open_remote", "declare_remote"]


def remote_capacity(config: KVStrataConfig, block_nbytes: int) -> int | None:
    """None when ``remote.*`` declares no server, else 0: a shared tier holds no block here."""
    return 0 if config.remote.enabled and config.remote.url else None


def open_remote(opening: Opening) -> RemoteTier:
    """The tier ``remote.*`` describes, for the deployment's (or its rank's) shard. ``options``:
    ``writer`` (False: it only reads and probes) and ``own_generation`` (False: a vLLM worker
    takes its scheduler's namespace generation)."""
    options = opening.options
    return RemoteTier.from_config(opening.config.remote, [opening.tier_id()], opening.block_nbytes,
                                  writer=bool(options.get("writer", True)),
                                  own_generation=bool(options.get("own_generation", True)))


def declare_remote(config: KVStrataConfig, capacity: int) -> Tier:
    """The remote tier's declaration: its server (credentials redacted) and ``remote.admission``."""
    remote = config.remote
    return dataclasses.replace(KNOWN[REMOTE], server=redact_url(remote.url), admission=remote.admission,
                               ghost_keys=ghost_keys(remote, None))


register(TierKind(KNOWN[REMOTE], section="remote", capacity=remote_capacity, open=open_remote, backend=RemoteTier,
                  position=900, configure=declare_remote, metrics=families,
                  commands=add_commands))
