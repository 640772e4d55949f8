"""Pieces shared by both halves of the vLLM connector: configuration,
fingerprints, and the small picklable messages that cross between them.

Scheduler -> worker (:class:`TierKVMetadata`, once per engine step):

* ``loads``: per request, ``(vllm block id, key, cpu slot or -1, promote slot or -1)``;
  a block comes from the CPU slab when its slot is given, else from the SSD
  tier (and is then also written into ``promote slot`` of the slab).
* ``spills``: ``(slot, key)`` pairs to copy from the slab to the SSD tier before
  the slot is reused (only when ``spill.write_through`` is off).
* ``stores``: newly full vLLM blocks -> ``(key, cpu slot or -1, write to SSD?)``.

Worker -> scheduler (:class:`TierKVWorkerMetadata`, aggregated over workers):
keys that turned out to be missing or corrupt, so the index forgets them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

import tierkv
from tierkv.config import TierKVConfig
from tierkv.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["load_config", "layout_fingerprint", "namespace_of", "worker_fingerprint",
           "block_nbytes_of", "LoadSpec", "StoreSpec", "TierKVMetadata", "TierKVWorkerMetadata"]

CONFIG_FILE_KEY = "config"


def load_config(extra: Mapping[str, Any] | None) -> TierKVConfig:
    """Build the config from ``kv_connector_extra_config``: an optional YAML file
    under ``"config"`` plus dotted-key overrides (``"cpu.capacity": "16GiB"``).
    Unknown keys raise :class:`ConfigError` naming the key."""
    overrides = dict(extra or {})
    path = overrides.pop(CONFIG_FILE_KEY, None)
    bad = [k for k in overrides if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"kv_connector_extra_config: keys must be strings, got {bad[0]!r}")
    try:
        if path is not None:
            return TierKVConfig.from_yaml(path, overrides)
        return TierKVConfig.from_dict({}, overrides)
    except ConfigError as exc:
        raise ConfigError(f"kv_connector_extra_config: {exc}") from None


def layout_fingerprint(vllm_config: "VllmConfig") -> dict[str, Any]:
    """Everything (except the TP rank) that makes KV bytes incompatible."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    return {
        "format": tierkv.FORMAT_VERSION,
        "model": str(mc.model),
        "revision": mc.revision,
        "dtype": str(mc.dtype),
        "kv_dtype": str(cc.cache_dtype),
        "block_size": int(cc.block_size),
        "layers": int(mc.get_num_layers(pc)),
        "kv_heads": int(mc.get_num_kv_heads(pc)),
        "head_size": int(mc.get_head_size()),
        "tp_size": int(pc.tensor_parallel_size),
        "pp_size": int(pc.pipeline_parallel_size),
    }


def namespace_of(fingerprint: Mapping[str, Any]) -> bytes:
    """The hash-chain namespace: a canonical serialisation of the fingerprint."""
    return json.dumps(dict(fingerprint), sort_keys=True, separators=(",", ":")).encode()


def worker_fingerprint(fingerprint: Mapping[str, Any], tp_rank: int) -> str:
    """The SSD tier fingerprint of one worker: the layout plus its TP rank."""
    return hashlib.sha256(namespace_of({**fingerprint, "tp_rank": tp_rank})).hexdigest()


def block_nbytes_of(kv_cache_config: "KVCacheConfig") -> int:
    """Bytes of one tierkv block (every layer's page, shared storage counted once)."""
    total = sum(int(t.size) for t in kv_cache_config.kv_cache_tensors)
    if total % kv_cache_config.num_blocks:
        raise ValueError(f"kv_cache_config: {total} bytes of KV tensors do not split into "
                         f"{kv_cache_config.num_blocks} blocks")
    return total // kv_cache_config.num_blocks


@dataclass
class LoadSpec:
    """One request's load: parallel lists, one entry per block, in prefix order."""

    req_id: str
    block_ids: list[int]
    keys: list[bytes]
    cpu_slots: list[int]      # source slot, or -1: read from the SSD tier
    promote_slots: list[int]  # for SSD blocks: slab slot to fill too, or -1


@dataclass
class StoreSpec:
    """Newly full vLLM blocks to copy down (parallel lists)."""

    block_ids: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    cpu_slots: list[int] = field(default_factory=list)  # -1: not kept in the CPU tier
    to_ssd: list[bool] = field(default_factory=list)

    def add(self, block_id: int, key: bytes, slot: int, to_ssd: bool) -> None:
        self.block_ids.append(block_id)
        self.keys.append(key)
        self.cpu_slots.append(slot)
        self.to_ssd.append(to_ssd)

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass
class TierKVMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    spills: list[tuple[int, bytes]] = field(default_factory=list)
    stores: StoreSpec = field(default_factory=StoreSpec)


@dataclass
class TierKVWorkerMetadata(KVConnectorWorkerMetadata):
    lost_keys: set[bytes] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TierKVWorkerMetadata), type(other)
        return TierKVWorkerMetadata(self.lost_keys | other.lost_keys)
