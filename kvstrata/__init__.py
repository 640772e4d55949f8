"""kvstrata: a multi-tier (GPU -> CPU DRAM -> SSD) KV-cache for LLM inference.

Heavy dependencies (torch, lmdb, cupy, vLLM) are imported lazily: ``import
kvstrata`` is cheap and works without them; the names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvstrata.errors import ConfigError, OutOfBlocksError
from kvstrata.identity.fingerprint import FORMAT_VERSION

__version__ = "0.1.0"

_LAZY = {
    "KVStrataConfig": "kvstrata.config.schema",
    "parse_size": "kvstrata.config.schema",
    "BlockHasher": "kvstrata.identity.hashing",
    "BlockManager": "kvstrata.pool.blocks",
    "Allocation": "kvstrata.pool.blocks",
    "CPUTier": "kvstrata.tiers.host",
    "SlotIndex": "kvstrata.policy.slot_index",
    "TierPolicy": "kvstrata.policy.manager",
    "PolicySpec": "kvstrata.policy.spec",
    "Fingerprint": "kvstrata.identity.fingerprint",
    "SSDTier": "kvstrata.tiers.ssd",
    "TieredKVCache": "kvstrata.library.tiered",
}

__all__ = ["ConfigError", "OutOfBlocksError", "FORMAT_VERSION", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstrata' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
