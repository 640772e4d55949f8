"""Drive vLLM's real v1 ``Scheduler`` (no model runner, no workers) with
kvstrata's ``KVStrataConnector`` in the scheduler role.

:class:`SchedulerHarness` builds the scheduler the way vLLM's ``EngineCore``
does (config objects, a KV cache config for the tiny Llama of
``tests/vllm_util.py``, vLLM's own request block hasher) and then stands in
for the model runner: each step it samples one fixed token for every request
whose prompt is complete after the step, and reports the connector's loads as
finished in the step that issued them (or asks a ``worker`` hook, which can
move real bytes and finish loads later).

Where the per-request numbers come from:

* ``gpu_hit_tokens``: the ``num_hits`` that the scheduler passes to
  ``KVCacheManager.record_prefix_cache_stats`` when it admits the request.
  That is the local (GPU prefix cache) hit after the scheduler reconciled it
  with the connector's answer; ``request.num_cached_tokens`` would mix local
  and external hits. The first admission counts: a preempted request that is
  admitted again keeps its first numbers (vLLM's ``PrefillStats`` does the same).
* ``external_hit_tokens``: what the connector's ``get_external_cache_hit_sources``
  returned for the request (keyed by ``CacheHitSource`` value, non-zero only).
  vLLM asks only when the hit is non-zero, the request was not preempted, and
  stats are on (the harness builds the scheduler with ``log_stats=True``).

vLLM keeps process-wide state (the ``NONE_HASH`` seed of its block hasher,
the connector registry); several harnesses in one process share it harmlessly.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["RequestResult", "SchedulerHarness", "Worker", "finish_every_load", "SAMPLED_TOKEN", "LAYERS", "KV_HEADS",
           "HEAD_SIZE", "layer_names", "block_nbytes"]

# The tiny Llama of tests/vllm_util.py (build_tiny_llama's defaults).
LAYERS = 2
KV_HEADS = 2
HEAD_SIZE = 64
DTYPE = torch.float32
SAMPLED_TOKEN = 5  # every "sampled" token: not a special id of the tiny tokenizer

# (metadata of this step) -> (ids of requests whose loads finished, worker metadata)
Worker = Callable[["KVConnectorMetadata | None"],
                  "tuple[set[str] | None, KVConnectorWorkerMetadata | None]"]


@dataclass
class RequestResult:
    request_id: str
    prompt_tokens: int
    gpu_hit_tokens: int                      # served from vLLM's own GPU prefix cache
    external_hit_tokens: dict[str, int] = field(default_factory=dict)  # CacheHitSource value -> tokens


def layer_names(layers: int = LAYERS) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(layers)]


def block_nbytes(block_size: int) -> int:
    """Bytes of one block over all layers: K and V, every KV head."""
    return LAYERS * 2 * KV_HEADS * HEAD_SIZE * block_size * DTYPE.itemsize


def finish_every_load(meta: "KVConnectorMetadata | None") -> tuple[set[str] | None, None]:
    """The default worker: every load in this step's metadata finishes within the step."""
    done = {spec.req_id for spec in getattr(meta, "loads", [])}
    return (done or None), None


def complete_every_plan(meta: Any) -> tuple[set[str] | None, Any]:
    """A worker without bytes: every load and store of the step is done within the step
    (the scheduler half alone is tested)."""
    from collections import Counter

    from kvstrata.connectors.vllm.common import KVStrataWorkerMetadata

    if meta is None:
        return None, None
    stored = Counter(p.plan_id for p in [*meta.early_stores, *meta.stores])
    return {p.req_id for p in meta.loads} or None, (KVStrataWorkerMetadata(stored=stored) if stored else None)


class RealWorker:
    """The connector's worker-side calls of one engine step, on a real ``KVStrataWorker``
    (its KV caches: CPU tensors laid out as vLLM's for the tiny model). Build it in
    ``before_scheduler``, as ``EngineCore`` builds its workers before its scheduler;
    pass it as the harness's ``worker``."""

    def __init__(self, vllm_config: Any, extra: dict[str, Any], kv_cache_config: Any) -> None:
        from kvstrata.connectors.vllm.common import load_config
        from kvstrata.connectors.vllm.worker import KVStrataWorker

        self.worker = KVStrataWorker(load_config(extra), vllm_config, kv_cache_config)
        block_size = int(vllm_config.cache_config.block_size)
        per_layer = block_nbytes(block_size) // LAYERS // DTYPE.itemsize
        n = int(kv_cache_config.num_blocks)
        self.worker.register_kv_caches({name: torch.zeros(n, per_layer, dtype=DTYPE) for name in layer_names()})
        self.load_errors = 0

    def __call__(self, meta: "KVConnectorMetadata | None") -> tuple[set[str] | None, Any]:
        w = self.worker
        if meta is None:
            return None, None
        w.before_forward(meta)
        w.start_load_kv(meta)
        w.wait_for_save(meta)
        _, recving = w.get_finished(set())
        self.load_errors += len(w.get_block_ids_with_load_errors())
        return recving, w.build_connector_worker_meta()


class SchedulerHarness:
    """A real vLLM ``Scheduler`` over ``num_gpu_blocks`` usable blocks, with
    ``KVStrataConnector`` attached when ``kv_connector_extra_config`` is not None.

    ``stall_timeout_s``: :meth:`run_group` raises when no step schedules a
    token and no load finishes for this long (e.g. a prompt that can never fit
    in the GPU pool, or a worker hook that never reports its loads).
    ``before_scheduler(vllm_config, kv_cache_config)`` runs once the configs are
    built and before the scheduler is: where ``EngineCore`` builds its workers.
    ``hybrid``: a hybrid model's KV cache instead, as vLLM's hybrid allocator lays it
    out: layer 0 full attention, then a layer of each kind given (``"sliding:<tokens>"``,
    ``"state"``: Mamba2 in vLLM's ``align`` prefix-caching mode), each a KV-cache group of
    its own over the same blocks (:func:`hybrid_kv_cache_config`). ``sliding_window``
    (tokens): ``hybrid=[f"sliding:{sliding_window}"]``.
    """

    def __init__(self, model_dir: str, *, block_size: int, num_gpu_blocks: int,
                 kv_connector_extra_config: dict[str, Any] | None,
                 max_num_batched_tokens: int = 1 << 16, max_num_seqs: int = 256,
                 max_model_len: int = 1 << 15, worker: Worker | None = None,
                 stall_timeout_s: float = 30.0,
                 before_scheduler: Callable[[Any, Any], None] | None = None,
                 sliding_window: int | None = None, hybrid: list[str] | None = None) -> None:
        if num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be positive, got {num_gpu_blocks}")
        from vllm_util import build_tiny_llama

        build_tiny_llama(model_dir)
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        with _environ_kept():
            from vllm.utils.hashing import get_hash_fn_by_name
            from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
            from vllm.v1.core.sched.scheduler import Scheduler
            from vllm.v1.structured_output import StructuredOutputManager

            self.vllm_config = _vllm_config(model_dir, block_size, kv_connector_extra_config,
                                            max_num_batched_tokens, max_num_seqs, max_model_len)
            # vLLM's BlockPool reserves block 0 as its null block.
            if sliding_window is not None:
                hybrid = [f"sliding:{sliding_window}"]
            if hybrid is None:
                self.kv_cache_config = _kv_cache_config(block_size, num_gpu_blocks + 1)
            else:
                self.kv_cache_config = hybrid_kv_cache_config(self.vllm_config, block_size, num_gpu_blocks + 1,
                                                              hybrid)
            self.vllm_config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
            if before_scheduler is not None:
                before_scheduler(self.vllm_config, self.kv_cache_config)
            self.scheduler: Scheduler = Scheduler(
                vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
                structured_output_manager=StructuredOutputManager(self.vllm_config),
                block_size=block_size, hash_block_size=block_size, log_stats=True)
        # As EngineCore: the prefix-cache hash function and its NONE_HASH seed.
        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._block_hasher = get_request_block_hasher(block_size, hash_fn)
        self.connector: KVConnectorBase_V1 | None = self.scheduler.connector
        self._worker: Worker = worker or finish_every_load
        self._stall_timeout_s = stall_timeout_s
        self._gpu_hits: dict[str, int] = {}
        self._external: dict[str, dict[str, int]] = {}
        self._instrument()
        self.steps = 0
        self._progressed = False

    # ------------------------------------------------------------------ recording

    def _instrument(self) -> None:
        """Record each request's local and external hits as the scheduler admits it."""
        manager = self.scheduler.kv_cache_manager
        record_stats = manager.record_prefix_cache_stats

        def record_prefix_cache_stats(request: "Request", num_hits: int) -> None:
            self._gpu_hits.setdefault(request.request_id, int(num_hits))
            record_stats(request, num_hits)

        manager.record_prefix_cache_stats = record_prefix_cache_stats  # type: ignore[method-assign]
        if self.connector is None:
            return
        sources_of = self.connector.get_external_cache_hit_sources

        def get_external_cache_hit_sources(request: "Request", num_external_tokens: int) -> Any:
            sources = sources_of(request, num_external_tokens)
            got = {str(getattr(k, "value", k)): int(v) for k, v in (sources or {}).items() if v}
            self._external.setdefault(request.request_id, got)
            return sources

        self.connector.get_external_cache_hit_sources = get_external_cache_hit_sources  # type: ignore[method-assign]

    # ------------------------------------------------------------------ driving

    def make_request(self, request_id: str, token_ids: list[int], max_tokens: int = 1,
                     cache_salt: str | None = None) -> "Request":
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        return Request(request_id=request_id, prompt_token_ids=list(token_ids),
                       sampling_params=params, pooling_params=None, cache_salt=cache_salt,
                       block_hasher=self._block_hasher)

    def step(self) -> "SchedulerOutput":
        """One engine step: schedule, emulate the model runner and worker, update."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        requests = self.scheduler.requests
        req_ids = list(out.num_scheduled_tokens)
        sampled = [[SAMPLED_TOKEN] if requests[r].num_computed_tokens >= requests[r].num_tokens else []
                   for r in req_ids]
        kv_output = None
        if self.connector is not None:
            recving, worker_meta = self._worker(out.kv_connector_metadata)
            kv_output = KVConnectorOutput(finished_recving=recving or None,
                                          kv_connector_worker_meta=worker_meta)
        runner_output = ModelRunnerOutput(req_ids=req_ids,
                                          req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                          sampled_token_ids=sampled, kv_connector_output=kv_output)
        self.scheduler.update_from_output(out, runner_output)
        self.steps += 1
        self._progressed = bool(out.total_num_scheduled_tokens or (kv_output and kv_output.finished_recving))
        return out

    def run_group(self, prompts: list[tuple[str, list[int]]], max_tokens: int = 1,
                  cache_salt: str | None = None) -> list[RequestResult]:
        """Add every prompt (request id, token ids) to the scheduler at once, then step until all
        have finished; return one result per prompt, in order."""
        ids = [rid for rid, _ in prompts]
        if len(set(ids)) != len(ids):
            raise ValueError(f"prompts: duplicate request ids in {ids}")
        for rid, toks in prompts:
            # The last sampled token is never written to the KV cache.
            need = -(-(len(toks) + max_tokens - 1) // self.block_size)
            if need > self.num_gpu_blocks:
                raise ValueError(f"prompts: {rid!r} needs {need} GPU blocks, the pool has "
                                 f"{self.num_gpu_blocks}; it could never be scheduled")
        reqs = [self.make_request(rid, toks, max_tokens, cache_salt) for rid, toks in prompts]
        for rid in ids:
            self._gpu_hits.pop(rid, None)
            self._external.pop(rid, None)
        for req in reqs:
            self.scheduler.add_request(req)
        self.drain()
        unfinished = [r.request_id for r in reqs if not r.is_finished()]
        assert not unfinished, f"requests {unfinished} did not finish"
        return [RequestResult(r.request_id, r.num_prompt_tokens, self._gpu_hits.get(r.request_id, 0),
                              self._external.get(r.request_id, {})) for r in reqs]

    def drain(self) -> None:
        """Step while the scheduler has work (as ``EngineCore`` does), including the
        step that tells workers about finished requests."""
        last_progress = time.monotonic()
        while self.scheduler.has_requests():
            self.step()
            now = time.monotonic()
            if self._progressed:
                last_progress = now
            elif now - last_progress > self._stall_timeout_s:
                raise RuntimeError(
                    f"scheduler stalled for {self._stall_timeout_s}s: "
                    f"{len(self.scheduler.running)} running, {len(self.scheduler.waiting)} waiting, "
                    f"{self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()} free GPU blocks")

    def reset_prefix_cache(self) -> bool:
        """Empty vLLM's GPU prefix cache (not the connector's tiers)."""
        return bool(self.scheduler.reset_prefix_cache())

    def close(self) -> None:
        self.scheduler.shutdown()


@contextmanager
def _environ_kept() -> Iterator[None]:
    """Undo the environment changes vLLM makes while importing and configuring.

    Its CPU platform sets variables for the worker processes an engine would
    spawn (``LD_PRELOAD``, ``VLLM_WORKER_MULTIPROC_METHOD``, thread counts...).
    The harness spawns none, and left in ``os.environ`` they would reach every
    subprocess that other tests start from this process.
    """
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


def _vllm_config(model_dir: str, block_size: int, extra: dict[str, Any] | None,
                 max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> "VllmConfig":
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm_util import loading_every_hit

    # No model runs: positions beyond the tiny model's own limit cost nothing.
    model = ModelConfig(model=model_dir, dtype="float32", max_model_len=max_model_len,
                        hf_overrides={"max_position_embeddings": max_model_len})
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    # A token budget larger than any prompt: no chunked prefill in practice.
    sched = SchedulerConfig(max_model_len=max_model_len, is_encoder_decoder=False,
                            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                            async_scheduling=False)
    kv = None
    if extra is not None:
        kv = KVTransferConfig(kv_connector="KVStrataConnector", kv_role="kv_both",
                              kv_connector_module_path="kvstrata.connectors.vllm",
                              kv_load_failure_policy="recompute",
                              kv_connector_extra_config=loading_every_hit(extra))
    return VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched,
                      kv_transfer_config=kv)


def _kv_cache_config(block_size: int, num_blocks: int) -> "KVCacheConfig":
    """One full-attention group over the tiny model's layers, placed as vLLM places them
    in a layer-outermost layout: one backing allocation, each layer a region of its own."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    names = layer_names()
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=DTYPE)
    page = spec.page_size_bytes
    assert page * len(names) == block_nbytes(block_size), (page, block_nbytes(block_size))
    tensors = [KVCacheTensor(size=page * num_blocks * len(names), layers=list(names),
                             layer_stride=page * num_blocks, block_stride=page)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                         kv_cache_groups=[KVCacheGroupSpec(names, spec)],
                         hash_block_size=block_size, cache_hit_alignment_tokens=block_size,
                         kv_cache_layout="LBHNC")  # the CPU backend's only layout


def hybrid_kv_cache_config(vllm_config: "VllmConfig", block_size: int, num_blocks: int,
                           kinds: list[str]) -> "KVCacheConfig":
    """The tiny model's layers as a hybrid: layer 0 full attention, then one layer of each of
    ``kinds`` (``"sliding:<tokens>"``, a sliding window; ``"state"``, a Mamba2 layer whose state
    vLLM keeps per block in its ``align`` prefix-caching mode, padded to the attention page as
    vLLM pads it); vLLM's own grouping and placement (one KV-cache group each, overlaying the
    same blocks)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    common = dict(block_size=block_size, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=DTYPE)
    full = FullAttentionSpec(**common)
    names = layer_names(1 + len(kinds))
    specs: dict[str, Any] = {names[0]: full}
    for name, kind in zip(names[1:], kinds):
        if kind == "state":  # a conv state and an SSM state, as a Mamba2 layer keeps them
            specs[name] = MambaSpec(block_size=block_size, shapes=((3, 4 * KV_HEADS), (KV_HEADS, HEAD_SIZE // 4, 16)),
                                    dtypes=(DTYPE, DTYPE), page_size_padded=full.page_size_bytes,
                                    mamba_cache_mode="align")
            vllm_config.cache_config.mamba_cache_mode = "align"
        else:
            specs[name] = SlidingWindowSpec(**common, sliding_window=int(kind.removeprefix("sliding:")))
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    vllm_config.cache_config.kv_cache_layout = "LBHNC"  # the CPU backend's only layout
    groups = get_kv_cache_groups(vllm_config, specs)
    assert len(groups) == len(specs), groups
    config = get_kv_cache_config_from_groups(vllm_config, groups, 1 << 34)
    config.kv_cache_layout = "LBHNC"
    assert config.num_blocks == num_blocks
    return config
