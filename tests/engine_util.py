"""Shared by the engine's tests and benchmarks/bench_engine.py: a tiny random-weight
Llama and transformers' own greedy generation as the reference."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Sequence

from vllm_util import build_tiny_llama

__all__ = ["build_engine_model", "hf_greedy", "random_prompt", "engine_config"]


def build_engine_model(path: str | Path, **kw: Any) -> Path:
    """The tiny Llama of the vLLM tests with GQA (4 query heads of 64 on 2 KV heads) and
    weights large enough (init 0.1) that the output depends on early context."""
    args: dict[str, Any] = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 256,
                            "init_range": 0.1}
    args.update(kw)
    return build_tiny_llama(path, **args)


def hf_greedy(model: Any, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation of ``prompt`` (stops at EOS, like the engine)."""
    import torch

    ids = torch.tensor([list(prompt)], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompt(n: int, seed: int, vocab: int = 500) -> list[int]:
    """``n`` random ids, avoiding the special ids 0 (BOS) and 1 (EOS)."""
    rng = random.Random(seed)
    return [rng.randrange(2, vocab) for _ in range(n)]


def engine_config(tmp: Path, *, gpu_blocks: int = 64, cpu: str = "4MiB", ssd: str | None = "16MiB",
                  device: str = "cpu", **extra: Any) -> dict[str, Any]:
    """An engine config with small tiers under ``tmp`` (``ssd=None``: no SSD tier)."""
    cfg: dict[str, Any] = {"gpu": {"num_blocks": gpu_blocks, "device": device}, "cpu": {"capacity": cpu},
                           "ssd": {"path": str(tmp / "ssd"), "capacity": ssd} if ssd else {"path": None}}
    cfg.update(extra)
    return cfg
