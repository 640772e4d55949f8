"""A small paged-attention engine over kvstrata's tiered cache (``LLMEngine``, ``kvstrata generate``).
May import every room below the engine; never the connectors or the command line.

``LLMEngine(model_path, config)`` runs a Hugging Face Llama-family checkpoint
(llama, mistral, qwen2, qwen3) with kvstrata managing every KV block: prefix
hits from the GPU pool, the CPU tier and the SSD tier, ``reshape_and_cache``
for the new tokens' K/V, ``paged_attention`` for decode, copy-on-write for
``n`` samples. It is the worked example of driving :class:`~kvstrata.TieredKVCache`
from a model, and the end-to-end check of the kernels and the tiers.

Needs torch and transformers (``pip install kvstrata[engine]``); imported on use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLMEngine", "RequestOutput"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvstrata.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'kvstrata.engine' has no attribute {name!r}")
