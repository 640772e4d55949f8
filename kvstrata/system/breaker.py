"""A circuit breaker: in front of the remote server (:mod:`kvstrata.tiers.remote`), and
in front of a tier whose reads stalled (:mod:`kvstrata.core.read_queue`).

Closed: every call goes through. After ``failures`` consecutive failures
(connection errors, timeouts) it opens: calls are refused at once (reads
miss, writes drop) for ``cooldown`` seconds, doubled after each failed probe
up to ``max_cooldown``. Then one caller at a time is let through as a probe:
its success closes the breaker, its failure opens it again.

Threads: any thread; one lock guards the state.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

__all__ = ["Breaker"]


class Breaker:
    def __init__(self, failures: int = 3, cooldown: float = 0.5, max_cooldown: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.failures = failures
        self.base_cooldown = cooldown
        self.max_cooldown = max_cooldown
        self.clock = clock
        self._lock = threading.Lock()
        self._streak = 0
        self._open_until: float | None = None
        self._cooldown = cooldown
        self._probing = False
        self.opened = 0   # times it opened

    @property
    def state(self) -> str:
        with self._lock:
            if self._open_until is None:
                return "closed"
            return "half-open" if self._probing or self.clock() >= self._open_until else "open"

    def allow(self) -> bool:
        """May a call go to the server now? (While open: one probe after the cooldown.)"""
        with self._lock:
            if self._open_until is None:
                return True
            if self._probing or self.clock() < self._open_until:
                return False
            self._probing = True
            return True

    def success(self) -> bool:
        """A call succeeded; True when that closed an open breaker."""
        with self._lock:
            was_open = self._open_until is not None
            self._streak = 0
            self._open_until = None
            self._probing = False
            self._cooldown = self.base_cooldown
            return was_open

    def failure(self) -> bool:
        """A call failed; True when that opened the breaker."""
        with self._lock:
            self._streak += 1
            if self._open_until is not None:  # a failed probe: wait longer
                self._probing = False
                self._cooldown = min(self.max_cooldown, self._cooldown * 2)
                self._open_until = self.clock() + self._cooldown
                return False
            if self._streak < self.failures:
                return False
            self._open_until = self.clock() + self._cooldown
            self.opened += 1
            return True
