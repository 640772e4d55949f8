"""The ``KVConnectorBase_V1`` subclass: each hook forwards to the half that
runs in this process (see :mod:`kvstrata.connectors.vllm`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstrata.connectors.vllm.common import KVStrataMetadata, load_config
from kvstrata.connectors.vllm.metrics import (
    CounterDeltas,
    KVStrataPromMetrics,
    KVStrataStats,
    scheduler_sample,
    worker_sample,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvstrata.connectors.vllm.common import KVStrataWorkerMetadata
    from kvstrata.connectors.vllm.scheduler import KVStrataScheduler
    from kvstrata.connectors.vllm.worker import KVStrataWorker

__all__ = ["KVStrataConnector"]


class KVStrataConnector(KVConnectorBase_V1, SupportsHMA):
    """Multi-tier (CPU DRAM -> SSD) prefix cache behind vLLM's own GPU cache. It keeps every
    KV-cache group of a hybrid model (``SupportsHMA``: vLLM keeps its hybrid allocator on)."""

    _cache_hit_source = CacheHitSource.HOST

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a future miss

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = load_config(self._kv_transfer_config.kv_connector_extra_config)
        self._scheduler: KVStrataScheduler | None = None
        self._worker: KVStrataWorker | None = None
        self._deltas = CounterDeltas()  # this half's counters at its last stats report
        if role == KVConnectorRole.SCHEDULER:
            from kvstrata.connectors.vllm.scheduler import KVStrataScheduler

            self._scheduler = KVStrataScheduler(cfg, vllm_config, kv_cache_config)
        else:
            from kvstrata.connectors.vllm.worker import KVStrataWorker

            self._worker = KVStrataWorker(cfg, vllm_config, kv_cache_config)

    @property
    def scheduler(self) -> "KVStrataScheduler":
        assert self._scheduler is not None, "scheduler-side hook called on the worker side"
        return self._scheduler

    @property
    def worker(self) -> "KVStrataWorker":
        assert self._worker is not None, "worker-side hook called on the scheduler side"
        return self._worker

    def _meta(self) -> KVStrataMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStrataMetadata), type(meta)
        return meta

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    # vLLM 0.33's sleep mode (0.32 has no such hooks and never calls them): before the KV
    # memory is released every copy ends and every view of it is dropped; after wake-up
    # the views are rebuilt over the same tensors. The CPU and SSD tiers keep their blocks.

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        return True

    def unregister_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.restore_kv_caches()

    # vLLM 0.34's connector API (0.32 and 0.33 never call these).

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any = None) -> bool:
        # False, deliberately: with lookahead hashing (EAGLE block drop) a block's KV also
        # depends on tokens after it, which kvstrata's keys (the block's tokens and its
        # prefix) do not cover, so a block stored under one continuation would be served
        # to another. vLLM then turns lookahead hashing off.
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any = None) -> Any:
        # IN_PROCESS, deliberately: the workers copy blocks with in-process torch ops and
        # kvstrata's own kernels; nothing registers the KV cache with an RDMA/UCX engine or
        # exports it to another process, so any allocation vLLM makes works.
        from vllm.config.kv_transfer import KVCacheAccess

        return KVCacheAccess.IN_PROCESS

    def may_load_async(self, request: "Request") -> bool:
        """vLLM 0.34 (``--max-num-inflight-kv-loads``): kvstrata loads every hit
        asynchronously, so a request whose first block the tiers below hold may start its
        load while the running batch is full."""
        return self.scheduler.may_load_async(request)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Called before the forward: blocks evicted in this step are stored now."""
        assert isinstance(kv_connector_metadata, KVStrataMetadata), type(kv_connector_metadata)
        self.worker.before_forward(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self.worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: the request waits for get_finished

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        return  # all layers are stored together in wait_for_save

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM's completion report: with several KV-cache groups a failed load fails its
        request (``failed_recving``: block ids are not unique across groups, and a window
        group cannot be truncated at a block), which vLLM then recomputes."""
        results = super().get_transfer_results(finished_req_ids)
        results.failed_recving |= self.worker.take_failed_requests()
        return results

    def build_connector_worker_meta(self) -> "KVStrataWorkerMetadata | None":
        return self._worker.build_connector_worker_meta() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ------------------------------------------------------------------ scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: "BlockPool") -> None:
        self.scheduler.bind_gpu_block_pool(gpu_block_pool)

    def on_new_request(self, request: "Request") -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: "Request",
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        return self.scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    def reset_cache(self) -> bool:
        return self.scheduler.reset_cache()

    def take_events(self) -> list[Any]:
        return self.scheduler.take_events() if self._scheduler is not None else []

    # ------------------------------------------------------------------ stats (both sides, see vllm_metrics)

    def get_kv_connector_stats(self) -> KVStrataStats | None:
        """What this half counted since its last report; None when nothing changed."""
        if self._worker is not None:
            return self._deltas.take(worker_sample(self._worker.counters()))
        return self._deltas.take(*scheduler_sample(self.scheduler.stats()))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVStrataStats:
        return KVStrataStats.from_payload(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig",
                           metric_types: dict[type["PromMetric"], type["PromMetricT"]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVStrataPromMetrics:
        return KVStrataPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
