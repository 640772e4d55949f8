"""kvstrata as SGLang's HiCache storage backend (a ``dynamic`` backend, SGLang 0.5.23's interface).

SGLang loads it with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstrata",
        "module_path": "kvstrata.connectors.sglang", "class_name": "KVStrataStorage",
        "interface_v1": 1, "ssd.path": "/data/kvstrata-sglang", "ssd.capacity": "200GiB",
        "model.id": "my-model-v1"}'

SGLang's ``StorageBackendFactory`` imports the module, checks the class is a
``HiCacheStorage`` and calls ``KVStrataStorage(storage_config, kwargs)``; the extra config
is checked then (:mod:`.config`). ``register_mem_pool_host`` follows: the pool's pages
(:mod:`.pools`) fix the fingerprint, and the tiers are opened then
(:class:`~kvstrata.connectors.kit.page_store.PageStore`, each rank in ``rank-<r>`` under
``ssd.path``).

The data path (``batch_exists``, ``batch_get_v1`` / ``batch_set_v1`` over the registered
pool, the generic ``get`` / ``set`` on flat pages) never raises: a key that is not 64 hex
digits, a ``host_indices`` batch that does not match the pool, a damaged or missing page, a
dead remote server or a full disk is a miss or a failed write, counted, and logged once to
SGLang's logger. ``get_stats`` returns SGLang's ``StorageMetrics`` with kvstrata's counters
under its ``kvstrata`` attribute.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, List, Optional, TypeVar

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvstrata.connectors.kit.kv_layout import LayoutRows
from kvstrata.connectors.kit.page_keys import PageKeys, leading
from kvstrata.connectors.kit.page_rows import BufferRows
from kvstrata.connectors.kit.page_store import PageStore
from kvstrata.connectors.sglang.config import load_backend_config
from kvstrata.connectors.sglang.hybrid import KV, PoolStores
from kvstrata.connectors.sglang.pools import check_parallel, host_pages, model_of, page_ids, sglang_fingerprint
from kvstrata.errors import ConfigError
from kvstrata.identity.ranks import Rank

__all__ = ["KVStrataStorage"]

log = logging.getLogger("sglang.srt.mem_cache.storage.kvstrata")
T = TypeVar("T")


class KVStrataStorage(HiCacheStorage):
    """SGLang's storage backend over kvstrata's SSD and remote tiers (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        self.storage_config = storage_config
        self.backend = load_backend_config(storage_config.extra_config)
        check_parallel(storage_config)
        self.model = model_of(self.backend.config, storage_config.model_name)
        sc = storage_config
        self.rank = Rank(tp=sc.tp_rank, pp=sc.pp_rank, dp=getattr(sc, "dp_rank", 0), tp_size=sc.tp_size,
                         pp_size=sc.pp_size)
        self.store: PageStore | None = None
        self.keys: PageKeys | None = None
        self.pages: Any = None
        self._host_rows: LayoutRows | None = None
        self.hybrid: PoolStores | None = None  # the pools registered beside the KV pool (v2)
        self._logged: set[str] = set()
        self._lock = threading.Lock()  # the I/O samples below
        self._io: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                            "backup_bandwidth": []}
        self.errors = 0

    # ------------------------------------------------------------------ registration

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Open the tiers for ``mem_pool_host``'s pages (a :class:`ConfigError` naming the pool's
        class or layout when kvstrata cannot serve it: SGLang's attach then fails)."""
        super().register_mem_pool_host(mem_pool_host)
        pages = host_pages(mem_pool_host)
        fingerprint = sglang_fingerprint(self.model, pages, self.storage_config)
        config = self.backend.with_landing(pages.block_nbytes)
        if self.store is not None:
            self.store.close()
        self.store = PageStore(config, fingerprint, block_nbytes=pages.block_nbytes, page_tokens=pages.page_size,
                               pool_pages=pages.page_num, rank=self.rank)
        self.pages = pages
        self.keys = PageKeys(fingerprint.namespace())
        self._host_rows = LayoutRows(pages.layout)
        if self.hybrid is not None:
            self.hybrid.close()
        self.hybrid = PoolStores(self.backend.config, fingerprint, self.keys, self.rank)
        log.info("kvstrata: HiCache storage for %s, rank %d: %s", fingerprint.describe(), self.rank.index,
                 ", ".join(t.name for t in self.store.policy.spec.tiers or ()))

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A hybrid model's other pool (a Mamba pool...): its pages get a page store of their
        own (:mod:`.hybrid`); after ``register_mem_pool_host``, else a :class:`ConfigError`."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if str(getattr(host_pool_name, "value", host_pool_name)) == KV:
            return  # the KV pool: register_mem_pool_host's
        if self.hybrid is None:
            raise ConfigError("host pools: register_mem_pool_host (the KV pool) must come first")
        self.hybrid.register(host_pool, host_pool_name)

    # ------------------------------------------------------------------ existence

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, the tiers hold (SSD, then the remote tier)."""
        return self._guard("batch_exists", 0, lambda: self._held(keys))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def _held(self, keys: List[str]) -> int:
        store, mapped = self._mapped(keys)
        if store is None:
            return 0
        return store.held(mapped[:leading(mapped)])

    def batch_exists_v2(self, keys: List[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """SGLang's ``PoolTransferResult``: the KV pages' leading run, cut to the last end
        point every pool of ``pool_transfers`` can restore (their intersection, never the
        minimum of their prefixes), and each pool's own."""
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        def exists() -> Any:
            kv_run = self._held(keys)
            if self.hybrid is None:
                return PoolTransferResult(0, {}, [])
            ends, hits = self.hybrid.restorable(keys, kv_run, pool_transfers)
            return PoolTransferResult(ends[-1] if ends else 0, hits, ends)

        return self._guard("batch_exists_v2", PoolTransferResult(0, {}, []), exists)

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, List[bool]]:
        """Per pool of ``transfers``, which pages arrived (the KV pool's zero copy)."""
        return self._per_pool("batch_get_v2", transfers, self._get_v1, lambda t: self.hybrid.get(t))

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, List[bool]]:
        """Per pool of ``transfers``, which pages a tier took (the KV pool's zero copy)."""
        return self._per_pool("batch_set_v2", transfers, self._set_v1, lambda t: self.hybrid.set(t))

    def _per_pool(self, what: str, transfers: Any, kv: Callable[[List[str], Any], List[bool]],
                  other: Callable[[Any], List[bool]]) -> dict[str, List[bool]]:
        out: dict[str, List[bool]] = {}
        for t in transfers or ():
            name = str(getattr(t.name, "value", t.name))
            keys = list(t.keys or ())
            if name == KV:
                out[name] = self._guard(what, [False] * len(keys), lambda: kv(keys, t.host_indices))
            elif self.hybrid is not None:
                out[name] = self._guard(what, [False] * len(keys), lambda: other(t))
            else:
                out[name] = [False] * len(keys)
        return out

    # ------------------------------------------------------------------ zero copy (v1)

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        """Read the pages of ``keys`` into the registered pool at ``host_indices``; True for
        the leading pages that arrived."""
        return self._guard("batch_get_v1", [False] * len(keys), lambda: self._get_v1(keys, host_indices))

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        """Store the registered pool's pages at ``host_indices`` under ``keys``; per key,
        whether a tier holds it or took it."""
        return self._guard("batch_set_v1", [False] * len(keys), lambda: self._set_v1(keys, host_indices))

    def _get_v1(self, keys: List[str], host_indices: torch.Tensor) -> List[bool]:
        ids = self._page_ids(keys, host_indices)
        store, mapped = self._mapped(keys)
        if store is None or ids is None:
            return [False] * len(keys)
        started = time.perf_counter()
        n = store.load(mapped[:leading(mapped)], self._host_rows, ids)
        self._sample("prefetch", n, started)
        return [i < n for i in range(len(keys))]

    def _set_v1(self, keys: List[str], host_indices: torch.Tensor) -> List[bool]:
        ids = self._page_ids(keys, host_indices)
        store, mapped = self._mapped(keys)
        if store is None or ids is None:
            return [False] * len(keys)
        return self._store(store, mapped, self._host_rows, ids)

    def _page_ids(self, keys: List[str], host_indices: Any) -> list[int] | None:
        pages = self.pages
        if pages is None:
            return None
        ids = page_ids(host_indices, len(keys), pages.page_size, pages.page_num)
        if ids is None:
            self._log_once("host_indices", "kvstrata: a host_indices batch that is not %d whole pages of the "
                           "registered pool was refused (counted as misses or failed writes)", len(keys))
        return ids

    # ------------------------------------------------------------------ generic (flat pages)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> List[Any]:
        """Read the pages of ``keys`` into ``target_locations`` (flat pages, as SGLang's
        ``get_dummy_flat_data_page``); each target, or None from the first page missed."""
        return self._guard("batch_get", [None] * len(keys), lambda: self._get_flat(keys, target_locations))

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat pages ``values`` under ``keys``; True when every one was taken."""
        return self._guard("batch_set", False, lambda: all(self._set_flat(keys, values)) and bool(keys))

    def _get_flat(self, keys: List[str], targets: Any) -> List[Any]:
        store, mapped = self._mapped(keys)
        if store is None or targets is None or len(targets) != len(keys):
            return [None] * len(keys)
        n = leading(mapped)
        started = time.perf_counter()
        loaded = store.load(mapped[:n], BufferRows(targets[:n], store.block_nbytes, writable=True), range(n))
        self._sample("prefetch", loaded, started)
        return [t if i < loaded else None for i, t in enumerate(targets)]

    def _set_flat(self, keys: List[str], values: Any) -> List[bool]:
        store, mapped = self._mapped(keys)
        if store is None or values is None or len(values) != len(keys):
            return [False] * len(keys)
        return self._store(store, mapped, BufferRows(values, store.block_nbytes, writable=False), range(len(keys)))

    def _store(self, store: PageStore, mapped: list[bytes | None], rows: Any, ids: Any) -> List[bool]:
        ids = list(ids)
        idx = [i for i, k in enumerate(mapped) if k is not None]
        started = time.perf_counter()
        ok = store.store([mapped[i] for i in idx], rows, [ids[i] for i in idx])
        out = [False] * len(mapped)
        for i, taken in zip(idx, ok):
            out[i] = taken
        self._sample("backup", sum(ok), started)
        return out

    # ------------------------------------------------------------------ helpers

    def _mapped(self, keys: List[str]) -> tuple[PageStore | None, list[bytes | None]]:
        """The store (None before a pool is registered) and the block keys of ``keys`` (None
        for each refused, logged once)."""
        store, page_keys = self.store, self.keys
        if store is None or page_keys is None:
            self._log_once("unregistered", "kvstrata: called before a host pool was registered (a miss)")
            return None, []
        mapped = page_keys.map(keys)
        if any(k is None for k in mapped):
            self._log_once("keys", "kvstrata: page keys that are not 64 hex digits were refused (misses or failed "
                           "writes; nothing stored was touched)")
        return store, mapped

    def _guard(self, what: str, default: T, fn: Callable[[], T]) -> T:
        """``fn()``; any exception is logged once per ``what``, counted, and ``default`` returned."""
        try:
            return fn()
        except Exception:
            self.errors += 1
            if what not in self._logged:
                self._logged.add(what)
                log.exception("kvstrata: %s failed; counted as a miss or a failed write", what)
            return default

    def _log_once(self, what: str, msg: str, *args: Any) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning(msg, *args)

    def _sample(self, kind: str, pages: int, started: float) -> None:
        """One I/O call's pages and bandwidth (GB/s) for SGLang's storage metrics."""
        if not pages or self.pages is None:
            return
        seconds = max(time.perf_counter() - started, 1e-9)
        with self._lock:
            self._io[f"{kind}_pgs"].append(pages)
            self._io[f"{kind}_bandwidth"].append(pages * self.pages.block_nbytes / seconds / 1e9)

    # ------------------------------------------------------------------ lifecycle

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and bandwidth per call since the last one), with
        kvstrata's counters (:meth:`PageStore.stats`) as its ``kvstrata`` attribute."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            io = {k: list(v) for k, v in self._io.items()}
            for v in self._io.values():
                v.clear()
        metrics = StorageMetrics(**io)
        stats = self._guard("get_stats", {}, lambda: self.store.stats() if self.store is not None else {})
        stats = {**stats, "refused_keys": self.keys.refused if self.keys is not None else 0, "errors": self.errors}
        if self.hybrid is not None and self.hybrid.pools:
            stats["pools"] = self._guard("get_stats", {}, self.hybrid.stats)
        metrics.kvstrata = stats  # type: ignore[attr-defined]
        return metrics

    def clear(self) -> None:
        """Forget every stored page (every tier), as SGLang's ``clear`` asks."""
        if self.store is not None:
            self._guard("clear", None, self.store.clear)

    def flush(self) -> bool:
        """Wait until every write accepted so far is down (tests, benchmarks)."""
        pools = self.hybrid is None or bool(self._guard("flush", False, self.hybrid.flush))
        return pools and (bool(self._guard("flush", False, self.store.flush)) if self.store is not None else True)

    def close(self) -> None:
        """Flush and close the tiers (SGLang calls it on detach and after a failed attach)."""
        store, self.store = self.store, None
        hybrid, self.hybrid = self.hybrid, None
        if hybrid is not None:
            self._guard("close", None, hybrid.close)
        if store is not None:
            self._guard("close", None, store.close)
