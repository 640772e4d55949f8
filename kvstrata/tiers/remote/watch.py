"""What a remote tier knows of its server: its health, its memory settings, and the counters.

:class:`ServerWatch` keeps the :class:`~kvstrata.system.breaker.Breaker`'s
view of the server (and logs when it opens and closes), reads ``INFO`` when the
tier connects and every :data:`INFO_EVERY` seconds (and warns when the server has
no ``maxmemory``, or a policy that never evicts), and keeps the tier's counters.

Threads: any thread may count; ``INFO`` is read by the tier's writer thread.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvstrata.system.breaker import Breaker
from kvstrata.tiers.remote.client import shown

__all__ = ["ServerWatch", "INFO_EVERY", "COUNTERS"]

log = logging.getLogger("kvstrata.tiers.remote.tier")

INFO_EVERY = 10.0           # seconds between INFO reads by the writer thread
_EVICTING = ("allkeys-lru", "allkeys-lfu", "allkeys-random")
COUNTERS = ("hits", "misses", "corrupt", "timeouts", "errors", "refused", "probes", "probe_hits",
            "puts", "written", "present", "replaced", "put_failures", "dropped_full", "dropped_breaker",
            "bytes_read", "bytes_written", "breaker_opened", "breaker_closed")


class ServerWatch:
    """The health, settings and counters of the server at ``where`` (a URL without its password)."""

    def __init__(self, client: Any, where: str, breaker: Breaker, capacity_bytes: int) -> None:
        self.client = client
        self.where = where
        self.breaker = breaker
        self.capacity_bytes = capacity_bytes
        self.server: dict[str, Any] = {}
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._info_at = 0.0

    def count(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self.counts[name] += n

    def snapshot(self) -> dict[str, Any]:
        """The counters, the breaker's state and what ``INFO`` said."""
        with self._lock:
            out: dict[str, Any] = dict(self.counts)
        out["breaker"] = self.breaker.state
        out["capacity_bytes"] = self.capacity_bytes
        out["server"] = dict(self.server)
        return out

    def succeeded(self) -> None:
        if self.breaker.success():
            self.count("breaker_closed")
            log.warning("remote tier: %s answers again", self.where)

    def failed(self, what: str, exc: BaseException) -> None:
        if self.breaker.failure():
            self.count("breaker_opened")
            log.warning("remote tier: %s failed %d times in a row (last: %s: %s); reads miss and writes drop "
                        "until it answers", self.where, self.breaker.failures, what, shown(exc))
        else:
            self.log_once(what, "remote tier: %s on %s failed (%s); counted as a miss or a dropped write",
                          what, self.where, shown(exc))

    def log_once(self, what: str, msg: str, *args: Any) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning(msg, *args)

    def maybe_info(self) -> None:
        """Read ``INFO`` when it is due (and the breaker lets a request through)."""
        now = time.monotonic()
        if now - self._info_at < INFO_EVERY or not self.breaker.allow():
            return
        self._info_at = now
        try:
            info = self.client.info()
        except Exception as exc:
            self.failed("info", exc)
            return
        self.succeeded()
        first = not self.server
        self.server = {k: info.get(k) for k in ("redis_version", "valkey_version", "maxmemory", "maxmemory_policy",
                                                "used_memory", "evicted_keys", "cluster_enabled") if k in info}
        if first:
            self._check_server()

    def _check_server(self) -> None:
        s = self.server
        maxmemory, policy = int(s.get("maxmemory") or 0), str(s.get("maxmemory_policy", "?"))
        log.info("remote tier: %s (version %s), maxmemory %d bytes, policy %s", self.where,
                 s.get("valkey_version") or s.get("redis_version"), maxmemory, policy)
        if maxmemory == 0:
            log.warning("remote tier: %s has no maxmemory: the store can grow without bound (set maxmemory "
                        "and maxmemory-policy allkeys-lru)", self.where)
        elif policy not in _EVICTING:
            log.warning("remote tier: %s evicts nothing under maxmemory-policy %s: writes fail once it is full "
                        "(set allkeys-lru)", self.where, policy)
        if maxmemory and self.capacity_bytes > maxmemory:
            log.warning("remote tier: remote.capacity (%d bytes) exceeds the server's maxmemory (%d bytes): the "
                        "server evicts first", self.capacity_bytes, maxmemory)
