"""Hybrid models under SGLang (the v2 interface): the pools beside the KV pages.

SGLang registers a hybrid model's other host pools with ``register_mem_host_pool_v2``
(a Mamba pool's states, a sliding window's pages...) and moves their pages with
``batch_get_v2`` / ``batch_set_v2``, one :class:`PoolTransfer` a pool. Each such pool's pages
are kept in a page store of their own (:class:`~kvstrata.connectors.kit.page_store.PageStore`:
the same policy, checksums and counters), under ``<ssd.path>/pool-<name>`` and bounded by
``ssd.capacity`` like the KV pages' tier, without a remote tier; a page is the pool's flat
data page (``get_data_page`` / ``set_from_flat_data_page``), keyed by its KV page's key
tagged with the pool's name, in a namespace of the pool's own (its page bytes, layout and
name are part of the fingerprint). The KV pool's own transfer goes the zero-copy way.

``batch_exists_v2`` returns the end points every pool can restore
(:mod:`kvstrata.connectors.kit.page_ends`): the KV pages from the first, each other pool
by its hit policy (every page, or the last ``len(keys)`` pages: a state), intersected;
the hit is the last shared end point, never the minimum of the pools' prefixes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, List, Optional

from kvstrata.config.schema import KVStrataConfig
from kvstrata.connectors.kit.page_ends import common_ends, legal_ends
from kvstrata.connectors.kit.page_keys import PageKeys
from kvstrata.connectors.kit.page_rows import BufferRows
from kvstrata.connectors.kit.page_store import PageStore
from kvstrata.errors import ConfigError
from kvstrata.identity.fingerprint import Fingerprint
from kvstrata.identity.ranks import Rank

__all__ = ["PoolStores"]

KV = "kv"  # SGLang's PoolName.KV


@dataclasses.dataclass
class _Pool:
    host: Any
    store: PageStore
    page_size: int


class PoolStores:
    """The page stores of the pools SGLang registered beside the KV pool (see the module
    docstring); ``fingerprint`` is the KV pages' (its model, ranks and variant are shared)."""

    def __init__(self, config: KVStrataConfig, fingerprint: Fingerprint, keys: PageKeys, rank: Rank) -> None:
        self.config = config
        self.fingerprint = fingerprint
        self.keys = keys
        self.rank = rank
        self.pools: dict[str, _Pool] = {}

    def register(self, host: Any, name: str) -> None:
        """Open the page store of pool ``name`` over SGLang's host pool ``host``."""
        name = str(getattr(name, "value", name))
        if not name or not name.replace("_", "").isalnum():
            raise ConfigError(f"host pool name {name!r}: expected letters, digits and underscores")
        if not self.config.ssd.enabled or not self.config.ssd.path:
            raise ConfigError(f"ssd.path: the {name} pool's pages are kept on the SSD tier only; set ssd.path")
        flat = host.get_dummy_flat_data_page()
        nbytes = int(flat.numel() * flat.element_size())
        page_size = int(getattr(host, "page_size", 1) or 1)
        fp = dataclasses.replace(self.fingerprint, dtype="uint8", kv_dtype="uint8", block_size=page_size,
                                 block_nbytes=nbytes, layers=int(getattr(host, "layer_num", None) or getattr(host, "num_mamba_layers", 0) or 0), kv_heads=0,
                                 head_size=0, variant=f"{self.fingerprint.variant}|pool={name}",
                                 kv_layout=f"sglang:{getattr(host, 'layout', '')}")
        ssd = dataclasses.replace(self.config.ssd, path=str(Path(self.config.ssd.path) / f"pool-{name}"))
        remote = dataclasses.replace(self.config.remote, url=None)
        config = dataclasses.replace(self.config, ssd=ssd, remote=remote)
        old = self.pools.pop(name, None)
        if old is not None:
            old.store.close()
        store = PageStore(config, fp, block_nbytes=nbytes, page_tokens=page_size,
                          pool_pages=max(1, int(host.size) // page_size), rank=self.rank)
        self.pools[name] = _Pool(host, store, page_size)

    # ------------------------------------------------------------------ existence

    def restorable(self, keys: List[str], kv_run: int, transfers: Any) -> tuple[list[int], dict[str, int]]:
        """The prefix lengths (pages) every pool of ``transfers`` can restore together with
        the first ``kv_run`` KV pages of ``keys``, ascending, and each pool's own longest."""
        ends = [set(range(1, kv_run + 1))]
        hits = {KV: kv_run} if kv_run else {}
        for t in transfers or ():
            name = str(getattr(t.name, "value", t.name))
            pool = self.pools.get(name)
            held = pool.store.holding(self._mapped(keys[:kv_run], name)) if pool is not None else [False] * kv_run
            trailing = str(getattr(t.hit_policy, "value", t.hit_policy)) == "trailing_pages"
            own = legal_ends(held, kv_run, max(1, len(t.keys or ())) if trailing else None)
            if own:
                hits[name] = max(own)
            ends.append(own)
        return common_ends(ends), hits

    # ------------------------------------------------------------------ data

    def get(self, transfer: Any) -> List[bool]:
        """Read pool pages of ``transfer`` into its host slots; True for the leading ones."""
        return self._each(transfer, self._get)

    def set(self, transfer: Any) -> List[bool]:
        """Store the pool pages at ``transfer``'s host slots; per key, whether it was taken."""
        return self._each(transfer, self._set)

    def _each(self, transfer: Any, fn: Callable[[_Pool, list[bytes | None], list[int]], List[bool]]) -> List[bool]:
        keys = list(transfer.keys or ())
        name = str(getattr(transfer.name, "value", transfer.name))
        pool = self.pools.get(name)
        starts = self._starts(pool, transfer.host_indices, len(keys)) if pool is not None else None
        if pool is None or starts is None:
            return [False] * len(keys)
        return fn(pool, self._mapped(keys, name), starts)

    def _get(self, pool: _Pool, mapped: list[bytes | None], starts: list[int]) -> List[bool]:
        n = next((i for i, k in enumerate(mapped) if k is None), len(mapped))
        pages = [pool.host.get_dummy_flat_data_page() for _ in range(n)]
        loaded = pool.store.load(mapped[:n], BufferRows(pages, pool.store.block_nbytes, writable=True), range(n))
        for page, start in zip(pages[:loaded], starts):
            pool.host.set_from_flat_data_page(start, page)
        return [i < loaded for i in range(len(mapped))]

    def _set(self, pool: _Pool, mapped: list[bytes | None], starts: list[int]) -> List[bool]:
        idx = [i for i, k in enumerate(mapped) if k is not None]
        pages = [pool.host.get_data_page(starts[i], flat=True).contiguous() for i in idx]
        taken = pool.store.store([mapped[i] for i in idx], BufferRows(pages, pool.store.block_nbytes, writable=False),
                                 range(len(idx)))
        out = [False] * len(mapped)
        for i, ok in zip(idx, taken):
            out[i] = ok
        return out

    def _mapped(self, keys: List[str], name: str) -> list[bytes | None]:
        return self.keys.map(keys, pool=name)

    @staticmethod
    def _starts(pool: _Pool, host_indices: Any, n: int) -> Optional[list[int]]:
        """The first host slot of each of ``n`` pages, or None when ``host_indices`` is not
        ``n`` whole pages of the pool."""
        try:
            flat = [int(i) for i in host_indices.reshape(-1).tolist()]
        except (AttributeError, TypeError, ValueError):
            return None
        ps = pool.page_size
        if len(flat) != n * ps or any(i < 0 or i >= int(pool.host.size) for i in flat):
            return None
        starts = flat[::ps]
        if any(flat[j * ps:(j + 1) * ps] != list(range(s, s + ps)) for j, s in enumerate(starts)):
            return None
        return starts

    # ------------------------------------------------------------------ lifecycle

    def stats(self) -> dict[str, Any]:
        return {name: pool.store.stats() for name, pool in self.pools.items()}

    def flush(self) -> bool:
        return all([pool.store.flush() for pool in self.pools.values()])

    def close(self) -> None:
        pools, self.pools = self.pools, {}
        for pool in pools.values():
            pool.store.close()
