"""Namespace generations: after a reset, nothing written before it is served.

A reset (``reset_prefix_cache(reset_connector=True)`` under vLLM,
:meth:`~kvstrata.library.tiered.TieredKVCache.reset` in the library) follows an in-place
weight update: the fingerprint, and so the namespace, did not change, but every
value in it holds KV of the old weights. So value keys carry a generation:
``kvstrata:<namespace>:<generation>:<block key>``, and a reset moves the replica
to a new generation, where none of the old values can be found.

* **The server's record.** ``<shard prefix>generation`` (:data:`GENERATION_KEY`
  after the prefix of the replica's first shard) holds the current generation:
  16 random hex digits. A replica that starts **joins** it (``SET NX`` a fresh one,
  then ``GET``: replicas that start together agree on one). A reset **bumps** it:
  a fresh random generation, ``SET`` over the old one; the replica moves to it.
* **Random, not a counter.** A generation is never made twice: the record
  evicted by ``allkeys-lru`` or deleted by an operator only makes the next
  replica that starts begin a new generation (misses), never return to an
  old one (an ``INCR`` counter would restart at 1, where old values may wait).
  So that ``allkeys-lru`` keeps it, a replica that joins or bumps reads the
  record again every :data:`TOUCH_EVERY` seconds with its reads (what it holds
  then is ignored: no following).
* **No following.** A replica that has not reset keeps its generation: it still
  runs the old weights, and serves and writes their KV among the replicas that
  have not reset either. A replica that starts joins the latest generation: it
  must be started with the weights the fleet now serves.
* **No convergence.** Two replicas that reset one after the other end on
  different generations and share nothing until they restart (they then join
  the latest): a replica cannot tell whether another one's reset was for the
  same weights. A fleet that wants to share at once after an update changes the
  model's identity (``model.id``) instead: replicas with the same identity share
  the same namespace.
* **The server unreachable.** A generation not yet joined or bumped (server
  down at start or at the reset) is unknown: the tier reads nothing and writes
  nothing until a later round trip settles it (reads retry it as the breaker
  lets them through). A pending bump stays a bump: a replica that reset never
  adopts a generation it did not make. A join made late joins the generation
  current then, as a start would. A join or bump whose answer arrives after a
  later reset is dropped.
* **Who decides.** The library's tier, and a vLLM scheduler half's, join and
  bump; a vLLM worker's tier is told its scheduler half's generation with every
  step's metadata (:meth:`Scoped.use_generation`), so every rank reads and
  writes the one the scheduler probes.
* **In flight.** A key is made when a read, probe or write is issued: work
  issued before the switch reads or writes the old generation's keys, so
  pre-reset bytes never land in the new generation. Drivers drop the answers
  of probes issued before a reset (see :mod:`kvstrata.connectors.kit.shared_lookups`);
  a vLLM scheduler refuses a reset while a fetch is planned or running, and a
  worker moves after the work it queued before (its later fetches wait for it).
* **Hostile input.** A record that is not a generation (another type, another
  length, not hex) is replaced by a fresh one (logged once). Whoever can write
  to the server can set the record to an older generation's value: a replica
  that starts then joins that generation, whose values verify (honest replicas
  signed them). Run the server where only the replicas can write.

Threads: any thread; :class:`Generation` guards its state with a lock. The
round trips run on the tier's reader thread (``RemoteTier._read``); :class:`Scoped`
(mixed into :class:`~kvstrata.tiers.remote.tier.RemoteTier`) makes every key from
the generation of the moment.
"""

from __future__ import annotations

import concurrent.futures as cf
import re
import secrets
import threading
import time
from typing import Any

__all__ = ["GENERATION_KEY", "Generation", "Scoped", "new_token"]

GENERATION_KEY = b"generation"
TOUCH_EVERY = 10.0  # seconds between reads of the record that keep it recently used
_TOKEN = re.compile(rb"[0-9a-f]{16}")
_JOIN, _BUMP = "join", "bump"


def new_token() -> bytes:
    """A generation nobody made before (64 random bits, as 16 hex digits)."""
    return secrets.token_hex(8).encode()


def valid(token: Any) -> bool:
    """Is ``token`` (a server's answer) a generation?"""
    return isinstance(token, bytes) and _TOKEN.fullmatch(token) is not None


class Generation:
    """The generation a replica reads and writes. ``record``: the server key that holds the
    current one (the replica joins it, and bumps it at a reset); None: it is set with
    :meth:`use` (a vLLM worker, told by its scheduler half)."""

    def __init__(self, record: bytes | None) -> None:
        self.record = record
        self.token: bytes | None = None  # None: unknown (the tier reads and writes nothing)
        self.resets = 0
        self._want: str | None = _JOIN if record is not None else None
        self._epoch = 0
        self._lock = threading.Lock()
        self._touched = time.monotonic()

    def due(self) -> bool:
        """Is it time to read the record again (so that the server's LRU keeps it)?"""
        if self.record is None or self.token is None or time.monotonic() - self._touched < TOUCH_EVERY:
            return False
        self._touched = time.monotonic()
        return True

    @property
    def pending(self) -> str | None:
        """``join`` or ``bump`` while a round trip must settle the generation, else None."""
        return self._want

    def reset(self) -> None:
        """Leave the current generation now; a new one is made by the next :meth:`settle`."""
        with self._lock:
            self.token = None
            self._want = _BUMP if self.record is not None else None
            self._epoch += 1
            self.resets += 1

    def use(self, token: bytes | None) -> None:
        """Read and write generation ``token`` from now on (None: nothing)."""
        with self._lock:
            self.token = token
            self._epoch += 1

    def settle(self, client: Any, log_once: Any) -> bytes | None:
        """One round trip to the server for a pending join or bump (``client``: redis-py's,
        a cluster's too); the generation then (None while still unknown). Raises what the
        client raises (the caller's breaker counts it)."""
        with self._lock:
            want, epoch = self._want, self._epoch
        if want is None or self.record is None:
            return self.token
        if want == _BUMP:
            token = new_token()
            client.set(self.record, token)
        else:
            token = _join(client, self.record, log_once)
        with self._lock:
            if self._epoch == epoch:  # no reset meanwhile: its answer is still the one wanted
                self.token, self._want = token, None
            return self.token


def _join(client: Any, record: bytes, log_once: Any) -> bytes:
    """The server's current generation, made now when it has none (or one that is not a
    generation: replaced)."""
    fresh = new_token()
    client.set(record, fresh, nx=True)
    try:
        token = client.get(record)
    except Exception as exc:  # another type under the record: WRONGTYPE
        if "WRONGTYPE" not in str(exc):
            raise
        token = None
    if valid(token):
        return token
    log_once("generation", "remote tier: %r does not hold a generation; it is replaced by a new one", record)
    client.set(record, fresh)
    return fresh


class Scoped:
    """The keys of a :class:`~kvstrata.tiers.remote.tier.RemoteTier` in its generation, and the
    moves between generations (mixed into the tier, which provides what is declared here)."""

    base: bytes                      # the prefix of the tier's shard
    base_probes: list[bytes]         # the prefixes of the shards it probes
    generation: Generation | None    # None: keys are the prefix and the block key
    client: Any
    watch: Any
    _read: Any                       # (what, fn, nskeys): fn(nskeys) on the reader thread, within the deadline
    _probe_pool_submit: Any          # (fn): fn() on the probe thread

    @property
    def prefix(self) -> bytes:
        """What every key of this tier's shard begins with now (its generation's included)."""
        scope = self._scope(settle=False)
        return self.base + (scope if scope is not None else b"?:")

    @property
    def probe_prefixes(self) -> list[bytes]:
        """The prefixes of the shards :meth:`probe` checks, now."""
        scope = self._scope(settle=False)
        return [p + (scope if scope is not None else b"?:") for p in self.base_probes]

    def key(self, key: bytes) -> bytes:
        return self.prefix + key

    def _scope(self, settle: bool = True) -> bytes | None:
        """What follows a shard's prefix in its keys now: the generation and ``:`` (empty
        without generations); None while the generation is unknown. ``settle``: first try
        a pending join or bump, within the deadline, when the breaker lets it through."""
        gen = self.generation
        if gen is None:
            return b""
        token = gen.token
        if token is None and settle and gen.pending is not None:
            self._read("generation", lambda _: gen.settle(self.client, self.watch.log_once), [])
            token = gen.token
        elif settle and gen.due():
            self._read("generation", lambda _: self.client.get(gen.record), [])
        return None if token is None else token + b":"

    def reset(self) -> None:
        """Leave the current generation: nothing written before is read or found from now on
        (writes already queued go to the old one). A new generation is made on the server by
        the next read (:meth:`settle_async` to start now); until then reads miss and puts drop."""
        if self.generation is not None:
            self.generation.reset()

    def use_generation(self, token: bytes | None) -> None:
        """Read and write generation ``token`` (None: nothing) from now on (a vLLM worker:
        its scheduler half's, on the thread that issues its reads and puts)."""
        if self.generation is None:
            self.generation = Generation(None)
        self.generation.use(token)

    @property
    def generation_token(self) -> bytes | None:
        """The generation read and written now (None: unknown, or no generations)."""
        return self.generation.token if self.generation is not None else None

    def settle(self) -> bytes | None:
        """Make a pending join or bump now (within the deadline); the generation then."""
        self._scope()
        return self.generation_token

    def settle_async(self) -> "cf.Future[Any] | None":
        """Join or bump the generation on the probe thread (None: nothing pending)."""
        gen = self.generation
        if gen is None or gen.pending is None:
            return None
        return self._probe_pool_submit(lambda: self._scope())
