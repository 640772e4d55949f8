"""The remote tier: blocks shared by replicas on a Redis or Valkey server.
May import: errors, system, identity, config, policy.

:mod:`.value` (keys under the shard's namespace, self-checked values), :mod:`.auth`
(the keys a deployment's secret becomes, sealed values), :mod:`.client` (pipelined
commands, a circuit breaker per node: :mod:`kvstrata.system.breaker`),
:mod:`.generation` (namespace generations), :mod:`.watch` (the server's health and
counters), :mod:`.tier` (:class:`RemoteTier`: reads within a deadline on a reader
thread) and :mod:`.writer` (its write-behind on a writer thread).
Nothing here raises to the caller for a server problem: it is a counted miss
or a dropped write. Imports ``redis`` only when a tier is made.
"""

from kvstrata.tiers.remote.value import key_prefix

__all__ = ["RemoteTier", "key_prefix"]


def __getattr__(name: str):  # RemoteTier lazily: importing kvstrata never needs redis
    if name == "RemoteTier":
        from kvstrata.tiers.remote.tier import RemoteTier

        return RemoteTier
    raise AttributeError(name)
