"""Pieces shared by both halves of the vLLM connector: configuration, the
fingerprint, and the small picklable messages that cross between them.

Scheduler -> worker (:class:`KVStrataMetadata`, once per engine step): the tier
policy's plans themselves (:mod:`kvstrata.policy.plans`), and the changes to
the set of hashed GPU blocks (:class:`ResidentDelta`) the worker mirrors so
that its shutdown can persist the hot set.

Worker -> scheduler (:class:`KVStrataWorkerMetadata`, aggregated over workers):
which store plans every worker finished, and which blocks turned out to be
missing or corrupt (so the policy forgets them).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvstrata.config.schema import KVStrataConfig, first_under, key_paths, read_yaml
from kvstrata.identity.groups import CHUNKED, FULL, SLIDING, STATE, Group, KVGroups
from kvstrata.errors import ConfigError
from kvstrata.identity.fingerprint import Fingerprint, model_identity
from kvstrata.identity.ranks import Rank
from kvstrata.connectors.kit.resident import ResidentDelta, ResidentMap
from kvstrata.core.deployment import policy_spec as deployment_spec
from kvstrata.policy import FetchPlan, LoadPlan, PolicySpec, StorePlan

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["load_config", "vllm_fingerprint", "policy_spec", "check_index_memory", "block_nbytes_of", "kv_groups", "retention_of",
           "kv_layout_name", "layer_spec", "num_workers", "engine_ranks", "ResidentDelta",
           "ResidentMap", "KVStrataMetadata", "KVStrataWorkerMetadata"]

CONFIG_FILE_KEY = "config"
_VLLM_OWNS = (
    ("block_size", "vLLM's --block-size sets it"),
    ("gpu.max_num_batched_tokens", "vLLM's --max-num-batched-tokens sets it"),
    ("gpu", "vLLM sizes its own KV pool (--gpu-memory-utilization or --kv-cache-memory-bytes)"),
    ("model.name", "taken from the model vLLM serves (set model.id to name its identity)"),
    ("model.layers", "taken from the model vLLM serves"),
    ("model.kv_heads", "taken from the model vLLM serves"),
    ("model.head_size", "taken from the model vLLM serves"),
    ("model.kv_dtype", "vLLM's --kv-cache-dtype sets it"),
    ("model.block_nbytes", "taken from vLLM's KV cache tensors"),
    ("model.groups", "taken from vLLM's KV-cache groups"),
)


def load_config(extra: Mapping[str, Any] | None) -> KVStrataConfig:
    """Build the config from ``kv_connector_extra_config``: an optional YAML file
    under ``"config"`` plus dotted-key overrides (``"cpu.capacity": "16GiB"``).
    Unknown keys, and keys vLLM decides, raise :class:`ConfigError` naming the key."""
    overrides = dict(extra or {})
    path = overrides.pop(CONFIG_FILE_KEY, None)
    bad = [k for k in overrides if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"kv_connector_extra_config: keys must be strings, got {bad[0]!r}")
    try:
        if path is not None:
            _reject_vllm_keys(key_paths(read_yaml(path)), f"{path}: ")
        _reject_vllm_keys(key_paths({}, overrides), "")
        cfg = KVStrataConfig.from_yaml(path, overrides) if path is not None else KVStrataConfig.from_dict({}, overrides)
    except ConfigError as exc:
        raise ConfigError(f"kv_connector_extra_config: {exc}") from None
    return cfg


def _reject_vllm_keys(paths: set[str], where: str) -> None:
    """Keys vLLM decides are errors whatever their value (checked before any value is)."""
    for key, why in _VLLM_OWNS:
        hit = first_under(paths, key)
        if hit is not None:
            raise ConfigError(f"{where}{hit}: not used under vLLM: {why}")


def block_nbytes_of(kv_cache_config: "KVCacheConfig") -> int:
    """Bytes of one kvstrata block: every byte one block id addresses, from where vLLM
    places each layer (``KVCacheTensor``: ``offset + l * layer_stride + b * block_stride``,
    the rest of a page's strides from the resolved layout, as ``create_kv_cache_views``
    computes them). Pages that alias each other (KV cache groups overlaid by the hybrid
    allocator, layers sharing a KV cache) count once, padding between pages not at all.
    :class:`~kvstrata.connectors.kit.kv_layout.KVLayout` finds the same bytes in the tensors
    themselves (the worker checks)."""
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes, compute_layout_strides

    from kvstrata.connectors.kit.kv_layout import block_runs, union_runs

    layout = _resolved_layout(kv_cache_config)
    nb = int(kv_cache_config.num_blocks)
    runs: dict[int, list[tuple[int, int]]] = {}  # block stride -> block 0's bytes
    for tensor in kv_cache_config.kv_cache_tensors:
        spec = layer_spec(kv_cache_config, tensor.layers[0])  # a tensor's layers share one spec
        if not spec.has_layer_views:
            raise ConfigError(f"layer {tensor.layers[0]}: its {type(spec).__name__} cache has no per-block pages "
                              "vLLM states the place of; kvstrata cannot store it")
        shape = compute_layer_kv_cache_shape_bytes(spec, nb)
        strides = compute_layout_strides(spec, nb, len(tensor.layers), layout,
                                         fixed_strides=(tensor.layer_stride, tensor.block_stride, None, None, None))
        for i in range(len(tensor.layers)):
            stride, block = block_runs(shape, strides[1:], 1, int(tensor.offset) + i * strides[0], nb,
                                       f"layer {tensor.layers[i]}")
            runs.setdefault(stride, []).extend(block)
    return sum(n for rs in runs.values() for _, n in union_runs(rs))


_STORED = ("full attention, sliding-window attention, chunked local attention and state (Mamba, linear "
           "attention, in vLLM's align prefix-caching mode)")


def kv_groups(kv_cache_config: "KVCacheConfig", block_size: int, retention: int | None = 0) -> KVGroups:
    """vLLM's KV-cache groups in kvstrata's terms (:mod:`kvstrata.identity.groups`), ``retention``
    its ``prefix_cache_retention_interval`` (:func:`retention_of`). A group of a kind kvstrata
    cannot store stops start-up: one line naming the layer and the kind."""
    out: list[Group] = []
    for group in kv_cache_config.kv_cache_groups:
        kinds = {_group_of(layer, layer_spec(kv_cache_config, layer)) for layer in group.layer_names}
        if len(kinds) != 1:
            raise ConfigError(f"KV-cache group of layers {', '.join(group.layer_names)}: layers of kinds "
                              f"{', '.join(sorted(k.describe() for k in kinds))}; kvstrata needs one kind per group")
        out.append(kinds.pop())
    return KVGroups(out, block_size, retention)


def retention_of(vllm_config: "VllmConfig") -> int | None:
    """vLLM's ``prefix_cache_retention_interval``: which window blocks its prefix cache keeps,
    and so the tiers below (:meth:`KVGroups.stored`). An engine without the setting keeps
    them all (None: dense)."""
    value = getattr(vllm_config.cache_config, "prefix_cache_retention_interval", None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


# Full-attention specs whose every block a hit needs (subclasses that drop blocks are refused).
_FULL = ("FullAttentionSpec", "MLAAttentionSpec", "SinkFullAttentionSpec")


def _group_of(layer: str, spec: Any) -> Group:
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec

    name = type(spec).__name__
    if isinstance(spec, SlidingWindowSpec):
        return Group(SLIDING, int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0) or 0))
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return Group(CHUNKED, int(spec.attention_chunk_size))
    if isinstance(spec, FullAttentionSpec) and name in _FULL:
        return Group(FULL)
    if isinstance(spec, MambaSpec):
        mode = getattr(spec, "mamba_cache_mode", None)
        if mode == "align":
            return Group(STATE)
        raise ConfigError(f"layer {layer}: a state layer ({name}) in vLLM's mamba_cache_mode {mode!r}, which keeps "
                          "no state per block position, so no prefix of this model can be served from a lower "
                          "tier: turn prefix caching on (--enable-prefix-caching, which selects "
                          "--mamba-cache-mode align: a state copy per block of 'block_size' tokens), or serve "
                          "the model without the KV connector")
    raise ConfigError(f"layer {layer}: a layer of kind {name}; kvstrata stores {_STORED} layers, not this kind: "
                      "serve the model without the KV connector")


def _resolved_layout(kv_cache_config: "KVCacheConfig") -> Any:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    name = getattr(kv_cache_config, "kv_cache_layout", None)
    if name is None:
        raise ValueError("kv_cache_config: no KV cache layout resolved (vLLM's engine core sets "
                         "kv_cache_layout before the connector is built)")
    return KVCacheLayout[name]


def layer_spec(kv_cache_config: "KVCacheConfig", layer: str) -> Any:
    """The ``KVCacheSpec`` of one layer (its group's, or its own in a group of mixed specs)."""
    for group in kv_cache_config.kv_cache_groups:
        if layer in group.layer_names:
            spec = group.kv_cache_spec
            specs = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
            return specs[layer] if specs is not None else spec
    raise ValueError(f"kv_cache_config: layer {layer} is in no KV cache group")


def kv_layout_name(kv_cache_config: "KVCacheConfig") -> str:
    """The KV cache layout vLLM resolved (``LBNHC``, ``LBHNC``, ...): a block's bytes differ
    between layouts, so it is part of the fingerprint."""
    return _resolved_layout(kv_cache_config).name


def vllm_fingerprint(cfg: KVStrataConfig, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> Fingerprint:
    """The fingerprint of the blocks this vLLM deployment computes (the same in every process)."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    groups = kv_groups(kv_cache_config, int(cc.block_size)).describe()  # refuses what cannot be stored, first
    return Fingerprint(
        model=model_identity(str(mc.model), mc.revision, cfg.model.id),
        dtype=str(mc.dtype), kv_dtype=str(cc.cache_dtype), block_size=int(cc.block_size),
        block_nbytes=block_nbytes_of(kv_cache_config), layers=int(mc.get_num_layers(pc)),
        kv_heads=int(mc.get_num_kv_heads(pc)), head_size=int(mc.get_head_size()), hash=cfg.hash,
        tp_size=int(pc.tensor_parallel_size), pp_size=int(pc.pipeline_parallel_size),
        variant=_variant(mc), kv_layout=kv_layout_name(kv_cache_config),
        groups=groups)


def _variant(mc: Any) -> str:
    """What vLLM changes about the checkpoint's KV beyond its files: quantization and config overrides."""
    parts = []
    if getattr(mc, "quantization", None):
        parts.append(f"quantization={mc.quantization}")
    overrides = getattr(mc, "hf_overrides", None)
    if overrides:
        text = (json.dumps(overrides, sort_keys=True, default=str) if isinstance(overrides, Mapping)
                else f"{getattr(overrides, '__module__', '?')}.{getattr(overrides, '__qualname__', repr(overrides))}")
        parts.append(f"hf_overrides={text}")
    return ";".join(parts)


def check_index_memory(spec: PolicySpec, block_nbytes: int, total_bytes: int | None = None) -> None:
    """Refuse a persistent (SSD) tier whose index would not fit the scheduler's machine once full
    (more than half its memory): a clear error at start-up, not an out-of-memory kill
    days later. ``total_bytes``: the machine's memory (by default
    :func:`~kvstrata.system.machine.total_memory_bytes`)."""
    from kvstrata.policy.holdings import index_bytes

    store = spec.tiers.store() if spec.tiers is not None else None
    need = index_bytes(spec.store_slots, eviction=store.eviction if store is not None else "lru")
    if total_bytes is None:
        from kvstrata.system.machine import total_memory_bytes

        total_bytes = total_memory_bytes()
    total = total_bytes or 0
    if total and need > total // 2:
        raise ConfigError(
            f"ssd.capacity: {spec.store_slots:,} blocks of {block_nbytes:,} bytes; indexing them takes "
            f"~{need / 2**30:.1f} GiB of the scheduler's memory, more than half of this machine's "
            f"{total / 2**30:.1f} GiB: use a smaller ssd.capacity or larger blocks (--block-size)")


def policy_spec(cfg: KVStrataConfig, kv_cache_config: "KVCacheConfig") -> PolicySpec:
    """The tier policy's spec under vLLM (its pool: ``kv_cache_config.num_blocks`` blocks,
    one of which vLLM keeps as its null block)."""
    return deployment_spec(cfg, block_nbytes=block_nbytes_of(kv_cache_config),
                           gpu_blocks=max(1, int(kv_cache_config.num_blocks) - 1))


def engine_ranks(vllm_config: "VllmConfig") -> list[Rank]:
    """Every worker of this (data-parallel) engine, rank 0 first."""
    pc = vllm_config.parallel_config
    tp, pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
    dp = int(getattr(pc, "data_parallel_rank", 0) or 0)
    return [Rank(t, p, dp, tp, pp) for p in range(pp) for t in range(tp)]


def num_workers(vllm_config: "VllmConfig") -> int:
    """Workers that each run every step's plans (and report them done)."""
    pc = vllm_config.parallel_config
    return int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size)


@dataclass
class KVStrataMetadata(KVConnectorMetadata):
    """One step's work for the workers.

    ``loads``: load plans, and fetch plans (shared tier -> slab slots), in the order the
    policy prepared them (their evictions run in that order).
    ``early_stores`` (blocks vLLM evicted in this step: their bytes are intact
    until this step's forward) run in ``handle_preemptions``, before the
    forward; ``loads`` in ``start_load_kv``; ``stores`` (computed blocks, the
    page-out window) in ``wait_for_save``.
    ``evictions``: per tier, keys to delete from it (the persistent tier's start-up overflow).
    ``reset``: delete every record of the worker's persistent tiers first (the weights changed:
    records the policy no longer knew of are stale too, and a put of a key still on
    disk only refreshes it).
    ``shared_generation``: the generation of the shared tier's namespace the workers fetch
    from and write to from this step on (None: unknown, they do neither; see
    :mod:`kvstrata.tiers.remote.generation`).
    ``tags``: key -> what to keep beside the persistent record of a block these plans (or a later
    step's spill) write there (with KV-cache events on: see :mod:`kvstrata.connectors.vllm.events`).
    ``reused``: device blocks vLLM handed out again in this step (the workers' forward
    must not rewrite them before pending copies out of them ran); None: not known, so
    every block with a pending copy is treated as reused.
    ``zero``: vLLM's ``new_block_ids_to_zero`` of this step, taken from the scheduler
    output: the workers zero these blocks in ``handle_preemptions``, after the copies out
    of them (model runner v2 zeroes before it calls ``handle_preemptions``).
    """

    loads: list[LoadPlan | FetchPlan] = field(default_factory=list)
    early_stores: list[StorePlan] = field(default_factory=list)
    stores: list[StorePlan] = field(default_factory=list)
    evictions: dict[str, list[bytes]] = field(default_factory=dict)
    reset: bool = False
    shared_generation: bytes | None = None
    reused: list[int] | None = None
    zero: list[int] = field(default_factory=list)
    resident: ResidentDelta = field(default_factory=ResidentDelta)
    tags: dict[bytes, bytes] = field(default_factory=dict)
    cut: list[str] = field(default_factory=list)  # requests whose loads read no more (past their deadline)
    prepared: bool = False  # set by the worker once the pre-forward part ran


@dataclass
class KVStrataWorkerMetadata(KVConnectorWorkerMetadata):
    """``stored``: store plan id -> workers that finished it. ``lost``: ``(tier, key)``
    of blocks a worker could not store or read. ``load_lost``: the same per request.
    ``fetched``: fetch plan id -> how many blocks arrived, one entry per worker.
    ``loads_done``: request id -> (block positions its finished load delivered, blocks it
    moved per tier, the seconds the copies took); over workers, the fewest positions and the
    slowest copies (they read their shards side by side). ``stalled``: requests whose loads
    were given up at their deadlines with reads still out (no sample of the tier's speed:
    the tier is stalled); ``returned``: requests whose given-up reads have since returned."""

    stored: Counter = field(default_factory=Counter)
    lost: set[tuple[str, bytes]] = field(default_factory=set)
    load_lost: dict[str, set[tuple[str, bytes]]] = field(default_factory=dict)
    fetched: dict[int, list[int]] = field(default_factory=dict)
    loads_done: dict[str, tuple[int, dict[str, int], float]] = field(default_factory=dict)
    stalled: set[str] = field(default_factory=set)
    returned: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVStrataWorkerMetadata), type(other)
        load_lost = {r: set(v) for r, v in self.load_lost.items()}
        for r, v in other.load_lost.items():
            load_lost.setdefault(r, set()).update(v)
        fetched = {p: list(v) for p, v in self.fetched.items()}
        for p, v in other.fetched.items():
            fetched.setdefault(p, []).extend(v)
        done = dict(self.loads_done)
        for r, (n, read, seconds) in other.loads_done.items():
            m, r_read, r_seconds = done.get(r, (n, read, seconds))
            done[r] = (min(n, m), read if seconds >= r_seconds else r_read, max(seconds, r_seconds))
        return KVStrataWorkerMetadata(self.stored + other.stored, self.lost | other.lost, load_lost, fetched, done,
                                      self.stalled | other.stalled, self.returned | other.returned)
