"""The deployment ``tierkv bench`` replays when no ``--config`` is given.

An 8B model (Llama-3-8B's KV layout, fp16: 128 KiB per token) served by vLLM on
one 48 GB card: 22 GiB of KV pool (about 180K tokens, enough for long-context
requests), a 64 GiB DRAM tier and a 1 TiB SSD tier, with the library's
default placement rules. ``--set`` overrides any of it (``--set
gpu.num_blocks`` replaces the pool's capacity).
"""

from __future__ import annotations

from typing import Any, Iterable

from tierkv.config import TierKVConfig

__all__ = ["DEFAULT_DEPLOYMENT", "default_config"]

DEFAULT_DEPLOYMENT: dict[str, Any] = {
    "model": {"name": "llama-3-8b", "layers": 32, "kv_heads": 8, "head_size": 128, "kv_dtype": "fp16"},
    "gpu": {"capacity": "22GiB"}, "cpu": {"capacity": "64GiB"}, "ssd": {"capacity": "1TiB"},
}


def default_config(overrides: Iterable[str] = ()) -> TierKVConfig:
    """The default deployment with ``--set`` style overrides applied."""
    overrides = list(overrides)
    base = {k: dict(v) for k, v in DEFAULT_DEPLOYMENT.items()}
    if any(isinstance(o, str) and o.split("=", 1)[0].strip() == "gpu.num_blocks" for o in overrides):
        base["gpu"].pop("capacity")  # one pool size: num_blocks and capacity are exclusive
    return TierKVConfig.from_dict(base, overrides)
