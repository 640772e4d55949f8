"""RemoteTier: blocks on a Redis or Valkey server, shared by every replica.

Never blocks or breaks the engine:

* **Reads** (:meth:`RemoteTier.probe`, :meth:`RemoteTier.get_into`) go to the
  server on a dedicated reader thread in pipelined batches of at most
  ``batch_bytes`` of values; the caller waits ``timeout`` seconds per batch at
  most, and what has not answered by then is a miss. A value is read only up to
  the longest this tier writes (``STRLEN`` and ``GETRANGE`` in one pipeline), so
  a huge value costs no more than a block. A value that does not verify
  (:mod:`.value`: signed with the deployment's secret), is too long or is not a
  string is a miss, counted, and deleted from the server.
* **Writes** are write-behind: :meth:`RemoteTier.put` copies the block into a
  queue bounded by ``queue_capacity`` bytes (a put beyond it is dropped and
  counted) and returns; one writer thread encodes and sends batches of at most
  ``batch_bytes`` as pipelined ``SET key value NX`` (keys are content
  addressed: a key present already holds the same block). With signed values,
  a key found present is checked: one that does not carry this writer's
  signature of the same bytes is overwritten, so a value planted before the
  honest writer cannot squat the key.
* **Generations** (:mod:`.generation`): with one, keys are
  ``<shard prefix><generation>:<block key>``; a reset (:meth:`RemoteTier.reset`)
  moves the tier to a new generation, and nothing written before is read again.
  While the generation is unknown (not yet joined, a bump not yet made, a worker
  not yet told) reads miss and puts drop, counted as refused.
* A :class:`~kvstrata.system.breaker.Breaker` opens after repeated
  connection failures or timeouts: reads miss and writes drop at once until a
  probe succeeds. A server that is down at start-up is logged, not fatal. On a
  cluster every round trip is split by node, each node with a breaker of its
  own: a dead node costs only the keys it owns.

The server bounds the store (``maxmemory`` with ``allkeys-lru``); kvstrata reads
``INFO`` when it connects and every :data:`INFO_EVERY` seconds, reports it in
:meth:`RemoteTier.stats`, and warns when the server has no ``maxmemory`` (it
can grow without bound) or a policy that never evicts (writes then fail).

Threads: any thread may call every method. The write-behind queue is the
:class:`~.writer.WriteBehind`'s (its own writer thread); the reader's state is guarded by
``_lock``; counters by the :class:`~.watch.ServerWatch`; the client's connection pool is
thread-safe.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from kvstrata.config.credentials import redact_url, url_has_password
from kvstrata.system.breaker import Breaker
from kvstrata.tiers.remote.client import Pipelines, connect
from kvstrata.tiers.remote.generation import GENERATION_KEY, Generation, Scoped
from kvstrata.tiers.remote.watch import COUNTERS, INFO_EVERY, ServerWatch
from kvstrata.tiers.remote.value import Auth, decode_into, max_value_bytes, value_bytes
from kvstrata.tiers.remote.writer import WriteBehind
from kvstrata.tiers.ssd.record import Codec, CorruptRecord

if TYPE_CHECKING:
    from kvstrata.config.remote import RemoteConfig

__all__ = ["RemoteTier", "connect", "INFO_EVERY", "COUNTERS"]

log = logging.getLogger(__name__)

_PROBE_BATCH = 1024         # keys per pipelined EXISTS round trip


class RemoteTier(Scoped):
    """The blocks of one shard (``prefix``, see :func:`~.value.key_prefix`) on a server.

    ``cfg``: the ``remote.*`` section; the tier reads its ``url`` (required), ``cluster``,
    ``capacity`` (None: 0, reported only), ``compression``, ``level``, ``timeout``,
    ``connect_timeout``, ``queue_capacity`` and ``batch_bytes``, never its secrets or
    password files (those are :meth:`from_config`'s: ``auth`` and ``password`` here).
    ``probe_prefixes``: the shards :meth:`probe` checks (all of them for a scheduler
    that answers for every tensor-parallel rank); by default ``prefix`` alone.
    ``writer``: False starts no writer thread (a tier that only reads and probes).
    ``breaker``: the round trips' :class:`~kvstrata.system.breaker.Breaker` (None: a default one).
    ``auth``: signs and verifies values (:class:`~.value.Auth`); None trusts the server
    (values unsigned: whoever can write to it can have their bytes served).
    ``password``: the server's password (None: the URL's own, if any).
    ``generation``: the namespace generation in every key (:mod:`.generation`); None: keys
    are ``prefix`` and the block key (tools, tests).
    """

    def __init__(self, cfg: RemoteConfig, prefix: bytes, block_nbytes: int, *,
                 probe_prefixes: Sequence[bytes] | None = None, writer: bool = True, breaker: Breaker | None = None,
                 auth: Auth | None = None, password: str | None = None, generation: Generation | None = None) -> None:
        if cfg.url is None:
            raise ValueError("no server: remote.url is not set")
        self.url = cfg.url
        self.auth = auth
        self.base = prefix
        self.base_probes = list(probe_prefixes) if probe_prefixes is not None else [prefix]
        self.generation = generation
        self.block_nbytes = block_nbytes
        self.capacity_bytes = cfg.capacity or 0
        self.timeout = cfg.timeout
        self.queue_capacity = cfg.queue_capacity
        self.batch_values = max(1, cfg.batch_bytes // value_bytes(block_nbytes, auth))
        self.max_value = max_value_bytes(block_nbytes, auth)
        self.codec = Codec(cfg.compression, cfg.level)
        self.breaker = breaker or Breaker()
        self.client = connect(cfg.url, cluster=cfg.cluster, timeout=cfg.timeout, connect_timeout=cfg.connect_timeout,
                              password=password)
        self.where = redact_url(cfg.url)  # what logs show
        self.watch = ServerWatch(self.client, self.where, self.breaker, self.capacity_bytes)
        self._lock = threading.Lock()  # the reader's and the prober's state
        self._pipes = Pipelines(self.client, cfg.cluster, self.watch.log_once)
        self._reader = cf.ThreadPoolExecutor(1, thread_name_prefix="kvstrata-remote-reader")
        self._busy = 0  # reads submitted and not finished (a stuck one makes the next miss at once)
        self._prober: cf.ThreadPoolExecutor | None = None
        self._writes = WriteBehind(self._pipes, self.watch, self.breaker, self.codec, auth, block_nbytes=block_nbytes,
                                   capacity_bytes=cfg.queue_capacity, batch_values=self.batch_values, start=writer)

    @classmethod
    def from_config(cls, cfg: RemoteConfig, tier_ids: Sequence[str], block_nbytes: int, *,
                    writer: bool = True, own_generation: bool = True) -> "RemoteTier":
        """The tier ``remote.*`` describes, for the shard ``tier_ids[0]`` (a
        :meth:`~kvstrata.identity.fingerprint.Fingerprint.tier_id`); :meth:`probe` checks every shard in
        ``tier_ids`` (a vLLM scheduler answers for all tensor-parallel ranks). Its generation
        is joined on the server now, within the deadline (``own_generation``; a server that
        is down: at a later read), or set with :meth:`use_generation` (a vLLM worker: its
        scheduler half's)."""
        from kvstrata.errors import ConfigError
        from kvstrata.tiers.remote.value import key_prefix

        assert cfg.url is not None, "remote.url is not set"
        secrets = cfg.secrets()
        auth = Auth(secrets, encrypt=cfg.encrypt) if secrets is not None else None
        if auth is None:
            log.warning("remote tier: remote.trust_server is on: values on %s are not signed, and whoever can "
                        "write to the server can have their bytes served as KV", redact_url(cfg.url))
        if url_has_password(cfg.url):
            log.warning("remote tier: remote.url carries a password; vLLM logs its connector config as given: "
                        "use remote.password_file or REDISCLI_AUTH instead")
        prefixes = [key_prefix(t, signed=auth is not None) for t in tier_ids]
        generation = Generation(prefixes[0] + GENERATION_KEY if own_generation else None)
        try:
            tier = cls(cfg, prefixes[0], block_nbytes, probe_prefixes=prefixes, writer=writer, auth=auth,
                       password=cfg.password(), generation=generation)
        except ValueError as exc:  # the client's own reading of the URL (its query options)
            raise ConfigError(f"remote.url: {redact_url(str(exc))}") from None
        tier.settle()
        return tier

    # ------------------------------------------------------------------ reads

    def probe(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the server holds (in every probed shard): the answer of
        ``EXISTS``, without reading or verifying a value (that is :meth:`get_into`'s job)."""
        held = 0
        scope = self._scope()
        prefixes = [p + scope for p in self.base_probes] if scope is not None else []
        for lo in range(0, len(keys) if prefixes else 0, _PROBE_BATCH):
            batch = keys[lo:lo + _PROBE_BATCH]
            nskeys = [p + k for k in batch for p in prefixes]
            answers = self._read("probe", self._exists, nskeys)
            if answers is None:
                break
            width = len(prefixes)
            n = 0
            while n < len(batch) and all(a == 1 for a in answers[n * width:(n + 1) * width]):
                n += 1
            held += n
            if n < len(batch):
                break
        self.count("probes", len(keys))
        self.count("probe_hits", held)
        return held

    def probe_each(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of ``keys`` the server holds (in every probed shard), each on its own (for a
        hit that needs some keys of each position only: KV-cache groups). Missing past the
        first batch the server did not answer."""
        out: list[bool] = []
        scope = self._scope()
        prefixes = [p + scope for p in self.base_probes] if scope is not None else []
        width = len(prefixes)
        for lo in range(0, len(keys) if prefixes else 0, _PROBE_BATCH):
            batch = keys[lo:lo + _PROBE_BATCH]
            answers = self._read("probe", self._exists, [p + k for k in batch for p in prefixes])
            if answers is None:
                break
            out += [all(a == 1 for a in answers[n * width:(n + 1) * width]) for n in range(len(batch))]
        out += [False] * (len(keys) - len(out))
        self.count("probes", len(keys))
        self.count("probe_hits", sum(out))
        return out

    def probe_async(self, keys: Sequence[bytes], each: bool = False) -> "cf.Future[Any]":
        """:meth:`probe` (or :meth:`probe_each`) on a thread of its own: a caller that must
        not wait long (a vLLM scheduler) polls the future, or waits for it briefly; it is done
        within the deadline of each batch."""
        keys = list(keys)
        done = self._probe_pool_submit(lambda: (self.probe_each if each else self.probe)(keys))
        if done is None:  # closed
            done = cf.Future()
            done.set_result([False] * len(keys) if each else 0)
        return done

    def _probe_pool_submit(self, fn: Any) -> "cf.Future[Any] | None":
        """``fn()`` on the probe thread (None when the tier is closed)."""
        with self._lock:
            if self._prober is None:
                self._prober = cf.ThreadPoolExecutor(1, thread_name_prefix="kvstrata-remote-probe")
        try:
            return self._prober.submit(fn)
        except RuntimeError:  # closed
            return None

    def get_into(self, keys: Sequence[bytes], rows: np.ndarray) -> int:
        """Read ``keys`` into ``rows[i]`` (``[len(keys), block_nbytes]`` uint8) up to the
        first that is missing, late or does not verify; returns how many leading rows hold
        their block. Rows from that one on hold nothing usable."""
        done = 0
        scope = self._scope()
        prefix = self.base + scope if scope is not None else None
        while done < len(keys) and prefix is not None:
            batch = keys[done:done + self.batch_values]
            nskeys = [prefix + k for k in batch]
            values = self._read("get", self._get, nskeys)
            n = self._decode(nskeys, values, rows[done:done + len(batch)]) if values is not None else 0
            done += n
            if n < len(batch):
                break
        self.count("hits", done)
        self.count("misses", len(keys) - done)
        return done

    def _decode(self, nskeys: list[bytes], values: list[Any], rows: np.ndarray) -> int:
        for i, (nskey, value) in enumerate(zip(nskeys, values)):
            if value is None:
                return i
            try:
                if isinstance(value, CorruptRecord):
                    raise value
                decode_into(nskey, value, rows[i], self.codec, self.auth)
            except CorruptRecord as exc:
                self.count("corrupt")
                self.watch.log_once("corrupt", "remote tier: a value under kvstrata's prefix does not verify (%s); "
                               "counted as a miss and deleted", exc)
                if self._writes.running:  # a probing-only tier sends nothing
                    self._writes.delete(nskey)
                return i
            self.count("bytes_read", len(value))
        return len(values)

    def _read(self, what: str, fn: Any, nskeys: list[bytes]) -> list[Any] | None:
        """``fn(nskeys)`` on the reader thread within the deadline; None when it is refused,
        fails or is late."""
        if self._writes.closed or not self.breaker.allow():
            self.count("refused")
            return None
        with self._lock:
            stuck = self._busy > 0  # the reader is stuck on an earlier call that missed its deadline
            if not stuck:
                self._busy += 1
        if stuck:
            self.count("refused")
            return None
        try:
            future = self._reader.submit(self._timed, fn, nskeys)
        except RuntimeError:  # closed meanwhile
            self._idle()
            return None
        try:
            return future.result(timeout=self.timeout)
        except cf.TimeoutError:
            self.count("timeouts")
            self.watch.failed(what, TimeoutError(f"no answer within {self.timeout:g} s"))
        except Exception as exc:  # a socket's own timeout is a late answer too, whichever clock fired first
            self.count("timeouts" if _late(exc) else "errors")
            self.watch.failed(what, exc)
        return None

    def _timed(self, fn: Any, nskeys: list[bytes]) -> list[Any]:
        try:
            out = fn(nskeys)
        finally:
            self._idle()
        self.watch.succeeded()
        return out

    def _idle(self) -> None:
        with self._lock:
            self._busy -= 1

    def _exists(self, nskeys: list[bytes]) -> list[Any]:
        return self._pipes.run(nskeys, lambda pipe, k: pipe.exists(k), 1, 0)

    def _get(self, nskeys: list[bytes]) -> list[Any]:
        """Each key's value (None: absent), read only up to the longest value this tier writes:
        a longer one, or one that is not a string, is a :class:`CorruptRecord` (not read)."""
        answers = self._pipes.run(nskeys, lambda pipe, k: (pipe.strlen(k), pipe.getrange(k, 0, self.max_value - 1)),
                                  2, None)
        out: list[Any] = []
        for length, value in zip(answers[::2], answers[1::2]):
            if length is None:  # the node that owns it did not answer
                out.append(None)
            elif isinstance(length, Exception) or isinstance(value, Exception):
                out.append(CorruptRecord("not a string value"))
            elif length > self.max_value:
                out.append(CorruptRecord(f"a value of {length:,} bytes; the longest valid one has {self.max_value:,}"))
            else:
                out.append(value if length else None)
        return out

    # ------------------------------------------------------------------ writes

    def put(self, key: bytes, row: Any) -> bool:
        """Queue one block (copied now) to be stored under ``key``; False (counted) when the
        queue is full or the breaker is open (:class:`~.writer.WriteBehind`)."""
        if self._writes.closed or self.breaker.state == "open":
            self.count("dropped_breaker")
            return False
        scope = self._scope(settle=False)
        if scope is None:  # the generation is unknown: where it would land is not known
            self.count("refused")
            return False
        return self._writes.put(self.base + scope + key, row)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued put, and every delete of a value that did not verify, was
        sent (or dropped); False on timeout."""
        return self._writes.flush(timeout)

    # ------------------------------------------------------------------ upkeep

    def count(self, name: str, n: int = 1) -> None:
        self.watch.count(name, n)

    @property
    def counts(self) -> dict[str, int]:
        return self.watch.counts

    def stats(self) -> dict[str, Any]:
        out = self.watch.snapshot()
        out["queued_bytes"] = self._writes.queued_bytes
        return out

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (for at most ``timeout`` seconds), then stop the threads."""
        if self._writes.closed:
            return
        self._writes.close(timeout)
        self._reader.shutdown(wait=False, cancel_futures=True)
        if self._prober is not None:
            self._prober.shutdown(wait=False, cancel_futures=True)
        try:
            self.client.close()
        except Exception:  # pragma: no cover - closing a broken connection
            pass


def _late(exc: BaseException) -> bool:
    """Whether ``exc`` is a read's socket giving up on an answer (not another failure)."""
    from redis.exceptions import TimeoutError as SocketTimeout

    return isinstance(exc, (TimeoutError, SocketTimeout))
