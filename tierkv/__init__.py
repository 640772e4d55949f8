"""tierkv: a multi-tier (GPU -> CPU DRAM -> SSD) KV-cache for LLM inference.

Heavy dependencies (torch, lmdb, cupy, vLLM) are imported lazily: ``import
tierkv`` is cheap and works without them; the names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from tierkv.errors import ConfigError, OutOfBlocksError

__version__ = "0.1.0"

# Bumped whenever the byte layout of stored blocks or the hash chain changes;
# it enters every namespace fingerprint, so old blocks can never be loaded.
FORMAT_VERSION = 1

_LAZY = {
    "TierKVConfig": "tierkv.config",
    "parse_size": "tierkv.config",
    "BlockHasher": "tierkv.hashing",
    "BlockManager": "tierkv.block_pool",
    "Allocation": "tierkv.block_pool",
    "CPUTier": "tierkv.cpu_tier",
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
