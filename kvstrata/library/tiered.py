"""TieredKVCache: kvstrata's own paged device pool over the tier policy and the executor.

A thin composition, deciding nothing about placement itself:

* the device pool (prefix cache, LRU free queue, block tables;
  :func:`~kvstrata.pool.protocol.pool_over_rows`): one block table over the rows
  for one full-attention group, a table per KV-cache group for a hybrid model
  (``model.groups``: vLLM's hybrid allocator, row 0 its null block; a hit is the
  longest prefix every group can serve, loaded whole or not at all);
* :class:`~kvstrata.policy.TierPolicy`: which lower tier holds each block,
  admission, cascade, promotion (``spill.*`` in the config);
* :class:`~kvstrata.dataplane.executor.Executor`: the bytes (device rows through
  :class:`~kvstrata.dataplane.transfer.TransferEngine`, the CPU slab, the SSD tier);
* metrics: counters and per-tier block lifecycles.

Each call is one step of the policy's protocol:

* :meth:`TieredKVCache.allocate`: the pool's cached prefix (a pure lookup),
  then the policy's lookup below it; the pool allocates (loaded blocks get
  new rows and are registered at once); the load is planned (its sources
  pinned); blocks the pool evicted in this call are offered as ``evicted``
  and copied down before any row is rewritten; the load runs; the page-out
  window is offered (``pageout``).
* :meth:`TieredKVCache.commit`: the caller wrote the KV of a request's tokens:
  its full blocks are registered in the pool and offered as ``computed``.
  A request freed without a commit (an abort) caches nothing.
* :meth:`TieredKVCache.close`: device-resident blocks the SSD tier lacks are
  offered as ``shutdown`` (most recently used first), then the SSD tier is
  flushed: a restart serves the hot set.
* :meth:`TieredKVCache.reset`: after an in-place weight update, every cached
  block of every tier is stale: the pool's prefix cache and the lower tiers
  forget them, the SSD tier's records are deleted and the remote tier moves to a
  new generation of its namespace (:mod:`kvstrata.tiers.remote.generation`).

Failures below the device (corrupt or unreadable SSD records, full queues,
pinned slots) are counted misses or dropped stores, never exceptions; a
block that fails to load is recomputed by the caller (it is not counted as
cached). Threading: one owner thread calls every method.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from kvstrata.pool.blocks import make_prompt
from kvstrata.pool.protocol import pool_over_rows
from kvstrata.config.schema import KVStrataConfig
from kvstrata.core.costs import fixed_costs
from kvstrata.core.deployment import executor_over, open_backends, policy_spec
from kvstrata.core.driver import DriverCore
from kvstrata.core.request import RequestState
from kvstrata.errors import ConfigError
from kvstrata.dataplane.device_rows import PoolRows
from kvstrata.dataplane.executor import Executor
from kvstrata.identity.groups import STATE, KVGroups, parse_groups
from kvstrata.identity.hashing import BlockHasher
from kvstrata.identity.fingerprint import Fingerprint
from kvstrata.core.metrics import Lifecycle, LifecycleRecorder, KVStrataCollector, lifecycle_sampling, policy_stats
from kvstrata.policy import TierPolicy
from kvstrata.policy.tiers import GPU
from kvstrata.policy.seeding import StoreSeeding

if TYPE_CHECKING:
    from kvstrata.dataplane.transfer import TransferEngine

__all__ = ["TieredKVCache", "TieredAllocation", "library_fingerprint", "model_groups"]

log = logging.getLogger(__name__)


def library_fingerprint(config: KVStrataConfig, block_nbytes: int | None = None) -> Fingerprint:
    """The fingerprint of a library cache: the model is ``model.id`` (else ``model.name``)."""
    m = config.model
    return Fingerprint(model=f"id:{m.id}" if m.id else f"name:{m.name}", dtype=m.kv_dtype, kv_dtype=m.kv_dtype,
                       block_size=config.block_size,
                       block_nbytes=config.block_nbytes() if block_nbytes is None else block_nbytes,
                       layers=m.layers, kv_heads=m.kv_heads, head_size=m.head_size, hash=config.hash,
                       groups=model_groups(config).describe())


def model_groups(config: KVStrataConfig) -> KVGroups:
    """The model's KV-cache groups (``model.groups``; by default one full-attention group)."""
    return KVGroups(parse_groups(config.model.groups, "model.groups"), config.block_size,
                    config.model.retention_interval)


def library_groups(config: KVStrataConfig) -> KVGroups:
    """:func:`model_groups`, refused with a state group: a state is cached only where a
    prefill stops (vLLM's align mode), and the library's caller computes a prompt at once."""
    groups = model_groups(config)
    if any(g.kind == STATE for g in groups.groups):
        raise ConfigError(f"model.groups: {config.model.groups!r}: the library serves full-attention, sliding-window "
                          "and chunked groups; a state group (Mamba) needs an engine that stops its prefill where a "
                          "state is cached (under vLLM the connector serves it)")
    return groups


@dataclass
class TieredAllocation:
    """A request's block table plus where its cached prefix came from.

    Call :meth:`wait` before attention reads ``block_ids``: loaded rows are
    copied asynchronously on CUDA (on CPU the copy is already done). With
    ``model.groups`` (a hybrid model), ``block_ids`` holds a block table per
    group, as vLLM's hybrid allocator gives them: row 0 is the null block where a
    group needs no block (before a sliding window).
    """

    block_ids: list[Any]
    num_cached_tokens: int
    hit_tokens: dict[str, int]
    hit_blocks: dict[str, int]
    _events: list[Any] = field(default_factory=list, repr=False)

    def wait(self) -> None:
        from kvstrata.dataplane.transfer import TransferEngine

        for ev in self._events:
            TransferEngine.wait_event(ev)
        self._events.clear()


class TieredKVCache:
    """Device pool + CPU tier + SSD tier behind one allocate/commit/append/fork/free API.

    ``kv_pool``: the device pool as ``[num_gpu_blocks, block_nbytes]`` uint8
    (a view of real KV storage is fine), or an engine's per-layer caches (a
    list of contiguous tensors whose dim 0 is the block id, such as each
    layer's K and V cache: a block is its page in every cache, in order);
    allocated from ``config`` when None.
    ``clock``: seconds for lifecycle metrics. ``fingerprint``: what the stored
    blocks are compatible with; derived from ``config`` when None.
    """

    def __init__(self, config: KVStrataConfig, *, kv_pool: Any = None, clock: Callable[[], float] | None = None,
                 record_samples: bool = False, fingerprint: Fingerprint | None = None) -> None:
        from kvstrata.dataplane.transfer import TransferEngine

        groups = library_groups(config)
        transfer = TransferEngine(kv_pool) if kv_pool is not None else None
        if transfer is not None:
            config.check_kv_pool(int(transfer.pool.shape[0]), transfer.block_nbytes, str(transfer.pool.device))
        self.config = config
        self.clock = clock or time.monotonic
        self.block_size = config.block_size
        self.block_nbytes = transfer.block_nbytes if transfer is not None else config.block_nbytes()
        num_blocks = (int(transfer.pool.shape[0]) if transfer is not None
                      else config.gpu.resolve_num_blocks(self.block_nbytes))
        self.fingerprint = fingerprint or library_fingerprint(config, self.block_nbytes)
        self.hasher = BlockHasher(self.block_size, config.hash, namespace=self.fingerprint.namespace())
        self.groups = groups
        self.manager = pool_over_rows(num_blocks, groups, hasher=self.hasher)
        spec = policy_spec(config, block_nbytes=self.block_nbytes, gpu_blocks=num_blocks)
        capacity = {GPU: num_blocks, **spec.capacity()}
        # Exact samples when asked for; otherwise large tiers are followed through a sample.
        self.lifecycle = {t: Lifecycle(record_samples, sample_every=1 if record_samples else
                                       lifecycle_sampling(n)) for t, n in capacity.items()}
        self.policy = TierPolicy(spec, clock=self.clock, observers=[LifecycleRecorder(
            {t: lc for t, lc in self.lifecycle.items() if t != GPU})])
        self.core = DriverCore(self.policy, self.block_size, groups,
                               costs=fixed_costs(config.load, spec, self.block_nbytes))
        self._pending: dict[int, Any] = {}  # device row -> event of an unfinished load copy
        self._metrics_server: Any = None
        self._seeding: StoreSeeding | None = None
        self.executor = self._open_executor(kv_pool, transfer, num_blocks)
        try:
            if config.metrics.port is not None:
                self.start_metrics_server(config.metrics.port, config.metrics.host)
        except BaseException:
            self._close_tiers()
            raise

    # ------------------------------------------------------------------ setup

    def _open_executor(self, kv_pool: Any, transfer: "TransferEngine | None", num_blocks: int) -> Executor:
        import torch

        from kvstrata.dataplane.transfer import TransferEngine

        cfg = self.config
        if kv_pool is None:
            kv_pool = torch.zeros((num_blocks, self.block_nbytes), dtype=torch.uint8, device=cfg.gpu.resolve_device())
            transfer = TransferEngine(kv_pool)
        assert transfer is not None
        self.kv_pool = kv_pool
        self.transfer = transfer
        backends = open_backends(cfg, self.policy.spec, self.fingerprint, self.block_nbytes)
        executor = executor_over(PoolRows(self.transfer), backends)
        persistent = executor.persistent
        if persistent is not None:
            self._seeding = StoreSeeding(self.policy, lambda: (list(persistent.keys()), []), [persistent])
            executor.evict([], {self.policy.store_tier: self._seeding.start()})
        return executor

    def _poll_seeding(self) -> None:
        """Hold what a background recovery of the SSD tier verified, once it is over."""
        if self._seeding is not None and self._seeding.pending:
            self.executor.evict([], {self.policy.store_tier: self._seeding.poll()})

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the SSD tier's background recovery (after an unclean shutdown) is
        over and hold what it verified; True if the tier then serves its records (also
        without an SSD tier). Requests need not wait: they miss on SSD until then."""
        ready = all([b.wait_ready(timeout) for b in self.executor.stores.values()])
        self._poll_seeding()
        return ready

    @property
    def remote(self) -> Any:
        """The remote tier (None without one)."""
        return self.executor.first_shared

    @property
    def cpu(self) -> Any:
        """The CPU slab (None without a CPU tier)."""
        return self.executor.slab

    @property
    def ssd(self) -> Any:
        """The SSD tier (None without one)."""
        return self.executor.persistent

    # --------------------------------------------------------------- requests

    @property
    def num_free_blocks(self) -> int:
        return self.manager.num_free_blocks

    def allocate(self, request_id: str, token_ids: Sequence[int] | None = None, *,
                 block_hashes: Sequence[bytes] | None = None, num_tokens: int | None = None,
                 cache_salt: str | bytes | None = None, lora_id: str | bytes | int | None = None) -> TieredAllocation:
        """Allocate a request's blocks, serving its cached prefix from any tier.

        Precomputed ``block_hashes`` are taken as full blocks; ``num_tokens``
        (optional with hashes) applies the last-token cap. Raises
        :class:`kvstrata.OutOfBlocksError` with nothing changed when the GPU pool
        is too small. Write the KV of the uncached tokens, then :meth:`commit`.
        """
        now = self.clock()
        self._poll_seeding()
        self.policy.forget_pairs(self.executor.take_lost())
        prompt = make_prompt(self.hasher, token_ids, block_hashes=block_hashes, num_tokens=num_tokens,
                             cache_salt=cache_salt, lora_id=lora_id)
        core, st = self.core, RequestState(request_id, prompt.hashes)

        def key(g: int, i: int) -> bytes:
            return st.group_key(g, i)

        gpu_hits = self.manager.lookup(prompt, key)
        below = core.lookup_now(st, self.executor, gpu_hits, prompt.cap)
        assert not self.manager.take_evicted(), "evictions are stored by the call that made them"
        alloc = self.manager.allocate(request_id, prompt=prompt, key=key, num_external=below,
                                      stored=lambda g, i: core.stored(st, g, i))
        self.core.admit(st, gpu_hits, alloc.tables, below, prompt.num_tokens)
        early, _ = self.core.end_step(self._take_evicted(), [])  # stored before the load rewrites their rows
        result = self.core.run(self.executor, early, st)
        if result.loaded < below:  # recomputed by the caller: nobody may hit those rows
            self.manager.invalidate(request_id, gpu_hits + result.loaded)
        cached = gpu_hits + result.loaded
        if result.event is not None:  # copies still running on CUDA: attention waits for them
            for row in self._rows(alloc.tables, gpu_hits, cached):
                self._pending[row] = result.event
        self._note_gpu(prompt.hashes, gpu_hits, prompt.hashes[gpu_hits:cached], now)
        self._store_step([], [], self.manager.free_window)  # the page-out window
        events = [ev for ev in (self._pending_event(r) for r in self._rows(alloc.tables, 0, cached)) if ev is not None]
        return TieredAllocation(alloc.block_ids, cached * self.block_size,
                                {t: b * self.block_size for t, b in st.hits.items()}, dict(st.hits), events)

    def commit(self, request_id: str, num_tokens: int | None = None) -> None:
        """The KV of the request's first ``num_tokens`` tokens (all when None) is written:
        its full blocks become hits for later requests and, under ``on_compute``
        admission, are stored below."""
        now = self.clock()
        done = self.manager.commit(request_id, num_tokens)
        lc = self.lifecycle[GPU]
        blocks = self.manager.blocks
        for block_id, h in done:
            if blocks[block_id].block_hash == h:
                lc.enter_new(h, now)
        self._store_step([], done)

    def append(self, request_id: str, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Append tokens (BlockManager semantics); returns the COW copies ``(src, dst)`` to perform.
        Blocks evicted to make room are stored below first (``evicted``)."""
        ops = self.manager.append(request_id, token_ids)
        self._store_step(self._take_evicted(), [])
        return ops

    def fork(self, parent_request_id: str, child_request_id: str) -> None:
        self.manager.fork(parent_request_id, child_request_id)

    def free(self, request_id: str) -> None:
        """Release a request; its committed blocks stay cached."""
        self.manager.free(request_id)

    def block_ids(self, request_id: str) -> list[int]:
        return self.manager.block_ids(request_id)

    @staticmethod
    def _rows(tables: Sequence[Sequence[int]], lo: int, hi: int) -> list[int]:
        """Every group's rows of positions ``lo .. hi - 1``."""
        return [row for table in tables for row in table[lo:hi]]

    # ------------------------------------------------------------------ stores

    def _take_evicted(self) -> list[tuple[int, bytes]]:
        """The blocks the pool evicted in this call; their rows are intact until the caller
        writes them (loads into them are queued after their stores)."""
        evicted = self.manager.take_evicted()
        now = self.clock()
        lc = self.lifecycle[GPU]
        for block_id, h in evicted:
            self._pending.pop(block_id, None)
            lc.leave(h, now)
        return evicted

    def _store_step(self, evicted: list[tuple[int, bytes]], computed: list[tuple[int, bytes]],
                    window: Any = None) -> None:
        early, late = self.core.end_step(evicted, computed, window)
        self.core.run(self.executor, early + late)

    # -------------------------------------------------------------- accounting

    def _pending_event(self, row: int) -> Any:
        ev = self._pending.get(row)
        if ev is not None and self.transfer.is_done(ev):
            del self._pending[row]
            return None
        return ev

    def _note_gpu(self, hashes: list[bytes], gpu_hits: int, loaded: list[bytes], now: float) -> None:
        lc = self.lifecycle[GPU]
        for h in hashes[:gpu_hits]:
            lc.access(h, now)
        for h in loaded:
            lc.enter_new(h, now)

    def stats(self) -> dict[str, Any]:
        """A snapshot of every counter (see the README's metrics table)."""
        ex = self.executor.stats()
        out: dict[str, Any] = {
            **self.core.counts.stats(self.block_size),
            **policy_stats(self.policy, gpu_evictions=self.core.gpu_evictions,
                           gpu_cached=self.manager.num_cached_blocks, gpu_blocks=self.manager.num_blocks),
            "spills_at_eviction": self.core.stored_at_eviction,
            "transfer": {d: dict(v) for d, v in self.transfer.moved.items()},
            "executor": ex,
            "lifecycle": {t: lc.samples() for t, lc in self.lifecycle.items()},
        }
        for tier, backend in (*self.executor.stores.items(), *self.executor.shared.items()):
            if callable(getattr(backend, "stats", None)):
                out[tier] = backend.stats()
        return out

    # -------------------------------------------------------------- lifecycle

    def start_metrics_server(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve Prometheus metrics for this cache on ``http://addr:port/metrics``."""
        from kvstrata.core.metrics import start_metrics_server

        self._metrics_server = start_metrics_server(port, KVStrataCollector(self.stats, self.lifecycle), addr)

    def reset(self) -> None:
        """Forget every cached block, as after an in-place weight update (the fingerprint did
        not change, the KV did): the device pool's prefix cache, the CPU tier, every record of
        the SSD tier, and on the remote tier everything written before (this cache moves to a
        new generation; other caches on the server keep theirs until they reset or restart).
        Raises ValueError, with nothing changed, while requests are allocated."""
        if self.manager.requests:
            names = ", ".join(sorted(self.manager.requests)[:3])
            raise ValueError(f"reset: {len(self.manager.requests)} requests are allocated ({names}...): free them "
                             "first (their KV is of the old weights)")
        self.transfer.synchronize()
        self._pending.clear()
        now = self.clock()
        for row, key in self.manager.resident():
            self.lifecycle[GPU].leave(key, now)
            self.manager.evict_cached(self.manager.blocks[row])
        if self._seeding is not None:
            self._seeding.cancel()
        self.policy.clear()
        self.policy.forget_pairs(self.executor.take_lost())
        if self.executor.stores:  # every record, once the writes queued so far landed: also those the policy did not hold
            self.executor.flush()
            self.executor.evict([], {t: list(b.keys()) for t, b in self.executor.stores.items()})
        for shared in self.executor.shared.values():
            shared.reset()
            shared.settle()  # makes the new generation now (a server that is down: at a later lookup)

    def flush(self) -> bool:
        """Wait until every pending copy and SSD write has finished (SSD writes synced).
        False when the SSD tier dropped a block it had accepted since the last flush (a
        full disk, an I/O error: its ``stats()["ssd"]["last_error"]`` says which)."""
        self.transfer.synchronize()
        self._pending.clear()
        for shared in self.executor.shared.values():
            shared.flush()
        return self.executor.flush()

    def close(self) -> None:
        """Store the device-resident blocks the SSD tier lacks (most recently used first,
        as many as it holds), flush, and release the tiers; the SSD tier persists."""
        if self.executor.stores:
            self.core.shutdown(self.executor, self.manager.resident())
        self.flush()
        self._close_tiers()

    def _close_tiers(self) -> None:
        below = [*self.executor.stores.values(), *self.executor.shared.values()]
        self.executor.stores.clear()
        self.executor.shared.clear()
        for backend in below:
            backend.close()
        server, self._metrics_server = self._metrics_server, None
        if server is not None and hasattr(server, "shutdown"):
            server.shutdown()
            server.server_close()

    def __enter__(self) -> "TieredKVCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
