"""tierkv: a multi-tier (GPU -> CPU DRAM -> SSD) KV-cache for LLM inference.

Heavy dependencies (torch, lmdb, cupy, vLLM) are imported lazily: ``import
tierkv`` is cheap and works without them; the names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from tierkv.errors import ConfigError, OutOfBlocksError
from tierkv.identity import FORMAT_VERSION

__version__ = "0.1.0"

_LAZY = {
    "TierKVConfig": "tierkv.config",
    "parse_size": "tierkv.config",
    "BlockHasher": "tierkv.hashing",
    "BlockManager": "tierkv.block_pool",
    "Allocation": "tierkv.block_pool",
    "CPUTier": "tierkv.tiers.host",
    "SlotIndex": "tierkv.policy.slot_index",
    "TierPolicy": "tierkv.policy.manager",
    "PolicySpec": "tierkv.policy.spec",
    "Fingerprint": "tierkv.identity",
    "SSDTier": "tierkv.tiers.ssd",
    "TieredKVCache": "tierkv.tiered",
}

__all__ = ["ConfigError", "OutOfBlocksError", "FORMAT_VERSION", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tierkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
