"""A page store: kvstrata's tiers below an engine's own host memory, driven page by page.

Some engines keep their own host-memory pool and ask a storage backend below it for pages by
key (SGLang's HiCache: ``batch_exists``, ``batch_get``, ``batch_set`` on pages of its host
pool). :class:`PageStore` is that backend's engine-neutral half, the fourth driver of
:class:`~kvstrata.core.driver.DriverCore` beside the library, the vLLM scheduler and the
replay. The engine's host pool plays the device pool's part: a page is a block (its block id
the page's position), and every call is one request of the step protocol:

* :meth:`PageStore.held`: how many pages, from the first, the tiers below hold (the local
  tiers, then the shared tier after them), cut where loading would lose to computing
  (``load.*``, :meth:`DriverCore.worth_loading`);
* :meth:`PageStore.load`: :meth:`DriverCore.lookup_now` (the shared tier's pages fetched
  first), the load admitted and run into the call's rows; how many pages arrived;
* :meth:`PageStore.store`: the pages offered as computed (:meth:`DriverCore.end_step`): the
  tier policy admits and places them, evicting by its orders within each tier's capacity.

Placement, admission, eviction, signed remote values and the counters are the deployment's
(:mod:`kvstrata.core.deployment`: the same spec, backends and executor as every driver);
nothing here decides where a page goes. A page that does not verify, a dead remote server or
a full disk is a miss or a refused write, counted, never an exception.

Threads: an engine calls from several threads (SGLang: its prefetch, prefetch I/O and backup
threads). The policy has one owner, so every verb runs under one lock; the SSD tier's writes
go on through its own writer thread, the remote tier's through its write-behind thread.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from kvstrata.config.schema import KVStrataConfig
from kvstrata.connectors.kit.page_rows import RoutedRows
from kvstrata.core.costs import fixed_costs
from kvstrata.core.deployment import executor_over, open_backends, policy_spec
from kvstrata.core.driver import DriverCore
from kvstrata.core.metrics import policy_stats
from kvstrata.core.request import RequestState
from kvstrata.policy import TierPolicy
from kvstrata.policy.seeding import StoreSeeding

if TYPE_CHECKING:
    from kvstrata.dataplane.device_rows import DeviceRows
    from kvstrata.identity.fingerprint import Fingerprint
    from kvstrata.identity.ranks import Rank

__all__ = ["PageStore"]


class PageStore:
    """The tiers ``config`` declares for pages of ``block_nbytes`` bytes (``page_tokens``
    tokens each) compatible with ``fingerprint``, below an engine pool of ``pool_pages``
    pages, opened for ``rank`` (its own SSD directory, ``rank-<index>`` under ``ssd.path``).
    ``options``: per tier name, what this driver asks of it (:func:`open_backends`)."""

    def __init__(self, config: KVStrataConfig, fingerprint: "Fingerprint", *, block_nbytes: int, page_tokens: int,
                 pool_pages: int, rank: "Rank | None" = None,
                 options: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.config = config
        self.fingerprint = fingerprint
        self.block_nbytes = block_nbytes
        self.page_tokens = page_tokens
        spec = policy_spec(config, block_nbytes=block_nbytes, gpu_blocks=pool_pages)
        self.policy = TierPolicy(spec)
        self.core = DriverCore(self.policy, page_tokens, costs=fixed_costs(config.load, spec, block_nbytes))
        self.rows = RoutedRows(block_nbytes)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.seconds = {"load": 0.0, "store": 0.0}
        self.backends = open_backends(config, spec, fingerprint, block_nbytes, rank=rank, options=options)
        self.executor = executor_over(self.rows, self.backends)
        self._seeding: StoreSeeding | None = None
        store = self.executor.persistent  # its records from before this start
        if store is not None:
            self._seeding = StoreSeeding(self.policy, lambda: (list(store.keys()), []), [store])
            self.executor.evict([], {self.policy.store_tier: self._seeding.start()})

    # ------------------------------------------------------------------ verbs

    def held(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the tiers below hold and are worth loading
        (pure: nothing is placed, touched or fetched; the shared tier is probed)."""
        if not keys:
            return 0
        with self._lock:
            self._upkeep()
            core, n = self.core, len(keys)
            st = RequestState(self._req("held"), list(keys))
            held = core.held_below(st, 0, n, note=False)
            local = core.worth_loading(st, 0, held)
            if local < held or held == n or not core.shared:
                return local
            answer = self.executor.probe(core.all_group_keys(st, held, n))
            on_shared = core.probed(answer, held, n)
            return held + core.worth_fetching(st, 0, held, on_shared)

    def holding(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the local tiers hold each of ``keys``, each on its own (pure: nothing is
        placed, touched or fetched; the shared tier is not asked): where a pool's pages may
        hold gaps, the legal end points of a hit are read from it (:mod:`.page_ends`)."""
        with self._lock:
            self._upkeep()
            holds = self.policy.holds
            return [holds(k) is not None for k in keys]

    def load(self, keys: Sequence[bytes], rows: "DeviceRows", block_ids: Sequence[int]) -> int:
        """Copy the pages of ``keys`` (from the first, as far as the tiers hold them) into
        blocks ``block_ids`` of ``rows``; returns how many arrived (a prefix)."""
        if not keys:
            return 0
        with self._lock:
            self._upkeep()
            started = time.perf_counter()
            core, n = self.core, len(keys)
            st = RequestState(self._req("load"), list(keys))
            with self.rows.using(rows):
                below = core.lookup_now(st, self.executor, 0, n)
                core.admit(st, 0, [list(block_ids[:below])], below, n * self.page_tokens)
                loaded = core.run(self.executor, [], st).loaded if below else 0
            core.finish(st.req_id)
            self.seconds["load"] += time.perf_counter() - started
            return loaded

    def store(self, keys: Sequence[bytes], rows: "DeviceRows", block_ids: Sequence[int]) -> list[bool]:
        """Offer the pages in blocks ``block_ids`` of ``rows`` under ``keys`` as computed;
        for each, whether a tier took it: holds it now, has it on its way (the remote tier's
        write-behind), or stored it and evicted it again for later pages of the same call."""
        if not keys:
            return []
        with self._lock:
            self._upkeep()
            started = time.perf_counter()
            with self.rows.using(rows):
                early, late = self.core.end_step([], list(zip(block_ids, keys)))
                self.core.run(self.executor, early + late)
            plans = early + late
            shared = self.policy.shared_tier
            taken = {plan.keys[i] for plan in plans for i in plan.writes.get(shared, ())}
            taken |= {k for plan in plans for keys in plan.evictions.values() for k in keys}  # stored, then evicted
            holds = self.policy.holds
            self.seconds["store"] += time.perf_counter() - started
            return [holds(k) is not None or k in taken for k in keys]

    def _req(self, what: str) -> str:
        return f"{what}-{next(self._ids)}"

    def _upkeep(self) -> None:
        """What the tiers did on their own since the last call: blocks the persistent tier
        dropped (forgotten), and a background recovery's records (held once it is over)."""
        self.policy.forget_pairs(self.executor.take_lost())
        if self._seeding is not None and self._seeding.pending:
            self.executor.evict([], {self.policy.store_tier: self._seeding.poll()})

    # ------------------------------------------------------------------ lifecycle

    def clear(self) -> None:
        """Forget every page of every tier (the key-addressed tiers' records deleted, the
        shared tiers moved to a new generation of their namespace), as after a weight update."""
        with self._lock:
            if self._seeding is not None:
                self._seeding.cancel()
            self.policy.clear()
            self.policy.forget_pairs(self.executor.take_lost())
            if self.executor.stores:
                self.executor.flush()
                self.executor.evict([], {t: list(b.keys()) for t, b in self.executor.stores.items()})
            for shared in self.executor.shared.values():
                shared.reset()

    def flush(self) -> bool:
        """Wait until every accepted write is down (the shared tier's written, the key-addressed
        tiers' synced); False when a key-addressed tier dropped one since the last flush."""
        shared = self.executor.first_shared
        if shared is not None:
            shared.flush()
        return self.executor.flush()

    def close(self) -> None:
        """Flush, then close the tiers (the persistent tier's records stay for the next start)."""
        with self._lock:
            try:
                self.flush()
            finally:
                self.backends.close()
                self.executor.persistent = self.executor.first_shared = None

    def stats(self) -> dict[str, Any]:
        """Every counter: hits per tier (``queries``, ``hits``), the policy's per-tier counts,
        the executor's, and each key-addressed and shared tier's own (under its name)."""
        with self._lock:
            out: dict[str, Any] = {
                **self.core.counts.stats(self.page_tokens),
                **policy_stats(self.policy),
                "executor": self.executor.stats(),
                "seconds": dict(self.seconds),
            }
            for name, backend in (*self.executor.stores.items(), *self.executor.shared.items()):
                if callable(getattr(backend, "stats", None)):
                    out[name] = backend.stats()
            return out
