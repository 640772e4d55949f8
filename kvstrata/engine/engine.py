"""LLMEngine: greedy generation with kvstrata managing every KV block.

One step is either a prefill of the requests just admitted (batched: their
uncached prompt tokens flattened into one forward) or a decode of every
running sequence (one token each, ``paged_attention`` over the batch). The
KV side is :class:`~kvstrata.TieredKVCache` and nothing else:

* admission: ``allocate`` serves the prompt's cached prefix from the pool,
  the CPU tier or the SSD tier (loaded blocks are waited for before the
  forward reads them); only the rest is computed;
* after every step that wrote KV: ``commit`` (full blocks become hits and,
  under ``on_compute`` admission, are stored below);
* ``n`` samples: the prompt's sequence is ``fork``-ed after prefill, so every
  sample shares its blocks; ``append`` returns the copy-on-write copies of a
  shared partial block, done with ``copy_blocks`` before the token is written;
* a finished sequence is ``free``-d: its blocks stay cached; ``close``
  stores what the pool holds to the SSD tier, so a restart serves it.

Scheduling is first come, first served without preemption: a request is
admitted when the blocks it can ever hold (prompt, outputs, a copy of the
partial block per extra sample) fit beside what the running requests may
still take, so no step ever runs out of blocks. Threading: one owner thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from kvstrata.config.schema import KVStrataConfig, format_size
from kvstrata.engine.kv import PagedKV, StepBatch, cache_dtype
from kvstrata.engine.model import DTYPES, ModelShape, PagedModel, read_model_shape
from kvstrata.errors import ConfigError
from kvstrata.identity.fingerprint import Fingerprint, model_identity
from kvstrata.kernels import copy_blocks
from kvstrata.kernels.specs import BLOCK_SIZES, HEAD_SIZES

__all__ = ["LLMEngine", "RequestOutput"]

KV_LAYOUT = "kvstrata-engine"  # per layer: K [blocks, kv_heads, head/x, block, x], V [blocks, kv_heads, head, block]


@dataclass
class RequestOutput:
    """One request: its ``n`` samples and where its prompt's KV came from
    (``hit_tokens`` per tier: ``gpu`` pool, ``cpu``, ``ssd``, ``remote``;
    ``computed_tokens``: prefilled here)."""

    request_id: str
    prompt_tokens: int
    samples: list[list[int]]
    hit_tokens: dict[str, int] = field(default_factory=dict)
    computed_tokens: int = 0
    finished: bool = False
    ttft_s: float = 0.0  # from admission to the first token
    logits: list[torch.Tensor] | None = None  # float32 [vocab] of each token of sample 0 (``return_logits``)


@dataclass
class _Sequence:
    seq_id: str
    output: list[int]
    kv_len: int          # tokens whose KV is in the cache
    done: bool = False


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    n: int
    cache_salt: str | bytes | None
    reserve: int
    out: RequestOutput
    seqs: list[_Sequence] = field(default_factory=list)
    admitted_at: float = 0.0


def _check_pool_memory(cfg: KVStrataConfig, num_blocks: int, device: torch.device) -> None:
    """Refuse a KV pool larger than the device can hold now, before allocating it, naming the
    key that sized it (``gpu.num_blocks`` or ``gpu.capacity``)."""
    from kvstrata.system.machine import available_memory_bytes

    need = num_blocks * cfg.block_nbytes()
    if device.type == "cuda":
        free = int(torch.cuda.mem_get_info(device)[0])
    else:
        free = available_memory_bytes()
    if free is not None and need > free:
        key = "gpu.num_blocks" if cfg.gpu.num_blocks is not None else "gpu.capacity"
        raise ConfigError(f"{key}: a KV pool of {num_blocks:,} blocks of {format_size(cfg.block_nbytes())} needs "
                          f"{format_size(need)}; {device.type} has {format_size(free)} free")


@dataclass(frozen=True)
class EnginePlan:
    """What an engine of a checkpoint and a config will be, known before anything is loaded or
    allocated: the model's shape, the config the engine runs, the dtypes and the pool's
    blocks. :meth:`check` tells whether a request can ever run (``kvstrata generate`` checks
    every prompt with it before the weights load)."""

    shape: ModelShape
    config: KVStrataConfig
    activation: torch.dtype
    kv_dtype: torch.dtype
    num_blocks: int

    @classmethod
    def of(cls, model_path: str | Path, config: KVStrataConfig | str | Path | Mapping[str, Any] | None = None, *,
           dtype: str | torch.dtype | None = None, kv_cache_dtype: str | None = None) -> "EnginePlan":
        shape = read_model_shape(model_path)
        cfg = _load_config(config)
        activation = _activation_dtype(dtype, shape)
        kv_name = _kv_name(cfg, kv_cache_dtype, activation)
        kv_dtype = cache_dtype(kv_name, activation)
        cfg = _engine_config(cfg, shape, kv_name)
        return cls(shape, cfg, activation, kv_dtype, cfg.gpu.resolve_num_blocks(cfg.block_nbytes()))

    def check(self, prompt: Sequence[int], max_new_tokens: int, n: int, what: str) -> tuple[list[int], int]:
        """The prompt's tokens and the blocks the request can ever hold; ConfigError naming
        ``what`` when it cannot run."""
        for name, value in (("max_new_tokens", max_new_tokens), ("n", n)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: expected a positive integer, got {value!r}")
        tokens = list(prompt)
        if not tokens:
            raise ConfigError(f"{what}: empty (a prompt needs at least one token)")
        vocab = self.shape.vocab_size
        bad = next((t for t in tokens if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ConfigError(f"{what}: token {bad!r} is not an id in [0, {vocab})")
        total = len(tokens) + max_new_tokens - 1
        limit = self.shape.max_positions
        if self.shape.sliding_window is not None:
            limit = min(limit, self.shape.sliding_window)
        if total > limit:
            why = "the sliding window" if limit == self.shape.sliding_window else "max_position_embeddings"
            raise ConfigError(f"{what}: {len(tokens)} tokens + {max_new_tokens} new exceed the model's "
                              f"{limit} positions ({why})")
        shared = len(tokens) // self.config.block_size
        reserve = shared + n * (math.ceil(total / self.config.block_size) - shared)
        if reserve > self.num_blocks:
            raise ConfigError(f"{what}: {len(tokens)} tokens + {max_new_tokens} new (n={n}) need {reserve} blocks "
                              f"of {self.config.block_size} tokens; the pool holds {self.num_blocks} "
                              f"(gpu.num_blocks)")
        return tokens, reserve


class LLMEngine:
    """A Llama-family checkpoint over kvstrata's tiered cache.

    ``config``: a :class:`KVStrataConfig`, a YAML path or a mapping; ``gpu.*`` sizes
    the engine's own pool (``gpu.device`` picks the device), the other sections the
    tiers below. ``model.*`` is taken from the checkpoint (a value set in the
    config must agree); ``model.id`` overrides the checkpoint's identity.
    ``dtype``: activations (default: the checkpoint's). ``kv_cache_dtype``: ``auto``
    (the activation dtype) or ``fp8`` / ``fp8_e4m3`` / ``fp8_e5m2`` with per-tensor
    ``k_scale`` / ``v_scale`` (FP8 stores ``x / scale``); default: ``model.kv_dtype``
    when the config sets it, else ``auto``.
    """

    def __init__(self, model_path: str | Path, config: KVStrataConfig | str | Path | Mapping[str, Any] | None = None,
                 *, dtype: str | torch.dtype | None = None, kv_cache_dtype: str | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        from kvstrata.library.tiered import TieredKVCache

        self.plan = plan = EnginePlan.of(model_path, config, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
        self.shape = shape = plan.shape
        self.config = cfg = plan.config
        activation, kv_dtype, num_blocks = plan.activation, plan.kv_dtype, plan.num_blocks
        self.device = torch.device(cfg.gpu.resolve_device())
        _check_pool_memory(cfg, num_blocks, self.device)
        self.kv = PagedKV(shape.num_layers, shape.num_kv_heads, shape.head_size, num_blocks, cfg.block_size, kv_dtype,
                          self.device, k_scale=k_scale, v_scale=v_scale)
        self.fingerprint = Fingerprint(
            model=model_identity(str(model_path), override=cfg.model.id), dtype=_name(activation),
            kv_dtype=_name(kv_dtype), block_size=cfg.block_size, block_nbytes=self.kv.block_nbytes(),
            layers=shape.num_layers, kv_heads=shape.num_kv_heads, head_size=shape.head_size, hash=cfg.hash,
            variant=f"k_scale={self.kv.k_scale!r},v_scale={self.kv.v_scale!r}" if kv_dtype != activation else "",
            kv_layout=KV_LAYOUT)
        self.cache = TieredKVCache(cfg, kv_pool=self.kv.caches, fingerprint=self.fingerprint)
        try:
            self.model = PagedModel(model_path, shape, activation, str(self.device))
        except BaseException:
            self.cache.close()
            raise
        self.block_size = cfg.block_size
        self.num_blocks = self.cache.manager.num_blocks
        self._waiting: deque[_Request] = deque()
        self._prefill: list[_Request] = []
        self._running: list[_Request] = []
        self._reserved = 0
        self._ids = itertools.count()
        self._counters = {"prompt_tokens": 0, "computed_tokens": 0, "generated_tokens": 0, "cow_copies": 0,
                          "prefill_steps": 0, "decode_steps": 0, "prefill_seconds": 0.0, "decode_seconds": 0.0}
        self._hits: dict[str, int] = {}

    # ------------------------------------------------------------- requests

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, n: int = 1,
                 cache_salt: str | bytes | None = None) -> list[list[list[int]]]:
        """Greedy continuations: for each prompt, ``n`` lists of up to ``max_new_tokens``
        token ids (a list ends early with an end-of-sequence token, included)."""
        return [out.samples for out in self.run(prompts, max_new_tokens, n=n, cache_salt=cache_salt)]

    def run(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, n: int = 1,
            cache_salt: str | bytes | None = None, return_logits: bool = False) -> list[RequestOutput]:
        """:meth:`generate`, with where each prompt's KV came from (and, with
        ``return_logits``, the logits behind sample 0's tokens). Every prompt is
        checked before any work starts."""
        checked = [self._check(p, max_new_tokens, n, f"prompts[{i}]") for i, p in enumerate(prompts)]
        ids = [self._add(p, max_new_tokens, n, cache_salt, reserve, return_logits) for p, reserve in checked]
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            done.update((o.request_id, o) for o in self.step())
        return [done[i] for i in ids]

    def add_request(self, prompt: Sequence[int], max_new_tokens: int, *, n: int = 1,
                    cache_salt: str | bytes | None = None) -> str:
        """Queue one request; :meth:`step` runs it. Returns its id."""
        tokens, reserve = self._check(prompt, max_new_tokens, n, "prompt")
        return self._add(tokens, max_new_tokens, n, cache_salt, reserve)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._prefill or self._running)

    def step(self) -> list[RequestOutput]:
        """One forward step (a prefill of what can be admitted, else a decode); returns the
        requests that finished in it."""
        self._admit()
        if self._prefill:
            batch, self._prefill = self._prefill, []
            self._run_prefill(batch)
        elif self._running:
            self._run_decode()
        finished = [r for r in self._running if all(s.done for s in r.seqs)]
        for r in finished:
            self._running.remove(r)
            self._reserved -= r.reserve
            r.out.finished = True
        return [r.out for r in finished]

    def _check(self, prompt: Sequence[int], max_new_tokens: int, n: int, what: str) -> tuple[list[int], int]:
        return self.plan.check(prompt, max_new_tokens, n, what)

    def _add(self, tokens: list[int], max_new_tokens: int, n: int, cache_salt: str | bytes | None,
             reserve: int, return_logits: bool = False) -> str:
        rid = f"req-{next(self._ids)}"
        out = RequestOutput(rid, len(tokens), [], logits=[] if return_logits else None)
        self._waiting.append(_Request(rid, tokens, max_new_tokens, n, cache_salt, reserve, out))
        return rid

    def _admit(self) -> None:
        while self._waiting and self._reserved + self._waiting[0].reserve <= self.num_blocks:
            req = self._waiting.popleft()
            self._reserved += req.reserve
            req.admitted_at = time.perf_counter()
            self._prefill.append(req)

    # ---------------------------------------------------------------- steps

    def _run_prefill(self, batch: list[_Request]) -> None:
        t0 = time.perf_counter()
        cached = []
        for req in batch:
            alloc = self.cache.allocate(req.request_id, req.prompt, cache_salt=req.cache_salt)
            alloc.wait()  # loaded blocks are in their rows before the forward reads them
            cached.append(alloc.num_cached_tokens)
            req.out.hit_tokens = {t: v for t, v in alloc.hit_tokens.items()}
            req.out.computed_tokens = len(req.prompt) - alloc.num_cached_tokens
            for tier, v in alloc.hit_tokens.items():
                self._hits[tier] = self._hits.get(tier, 0) + v
        tokens = [t for req, c in zip(batch, cached) for t in req.prompt[c:]]
        positions = [p for req, c in zip(batch, cached) for p in range(c, len(req.prompt))]
        step = StepBatch.build(self.block_size, [self.cache.block_ids(r.request_id) for r in batch], cached,
                               [len(r.prompt) - c for r, c in zip(batch, cached)], self.device)
        logits = self._forward(tokens, positions, step)
        now = time.perf_counter()
        for req, row in zip(batch, logits):
            self.cache.commit(req.request_id)
            req.seqs = [_Sequence(req.request_id, [], len(req.prompt))]
            for i in range(1, req.n):  # the samples share every prompt block
                child = f"{req.request_id}#{i}"
                self.cache.fork(req.request_id, child)
                req.seqs.append(_Sequence(child, [], len(req.prompt)))
            req.out.samples = [s.output for s in req.seqs]
            req.out.ttft_s = now - req.admitted_at
            for seq in req.seqs:
                self._emit(req, seq, row)
            self._running.append(req)
        c = self._counters
        c["prompt_tokens"] += sum(len(r.prompt) for r in batch)
        c["computed_tokens"] += len(tokens)
        c["prefill_steps"] += 1
        c["prefill_seconds"] += time.perf_counter() - t0

    def _run_decode(self) -> None:
        t0 = time.perf_counter()
        seqs = [s for r in self._running for s in r.seqs if not s.done]
        copies: list[tuple[int, int]] = []
        for seq in seqs:  # the token sampled last gets its KV now
            copies += self.cache.append(seq.seq_id, [seq.output[-1]])
        if copies:  # copy-on-write of shared partial blocks, before any token lands in them
            copy_blocks(self.kv.caches, copies)
            self._counters["cow_copies"] += len(copies)
        step = StepBatch.build(self.block_size, [self.cache.block_ids(s.seq_id) for s in seqs],
                               [s.kv_len for s in seqs], [1] * len(seqs), self.device)
        logits = self._forward([s.output[-1] for s in seqs], [s.kv_len for s in seqs], step)
        owner = {s.seq_id: r for r in self._running for s in r.seqs}
        for seq, row in zip(seqs, logits):
            seq.kv_len += 1
            self.cache.commit(seq.seq_id)
            self._emit(owner[seq.seq_id], seq, row)
        self._counters["decode_steps"] += 1
        self._counters["decode_seconds"] += time.perf_counter() - t0

    def _forward(self, tokens: list[int], positions: list[int], step: StepBatch) -> torch.Tensor:
        """Logits ([num_seqs, vocab] float32, on the CPU) of each sequence's last token."""
        t = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        return self.model.forward(t, pos, step, self.kv).cpu()

    def _emit(self, req: _Request, seq: _Sequence, logits: torch.Tensor) -> None:
        """Greedy: the next token is the argmax of ``logits``."""
        token = int(logits.argmax())
        if req.out.logits is not None and seq is req.seqs[0]:
            req.out.logits.append(logits)
        seq.output.append(token)
        self._counters["generated_tokens"] += 1
        if len(seq.output) >= req.max_new_tokens or token in self.shape.eos_token_ids:
            seq.done = True
            self.cache.free(seq.seq_id)

    # ------------------------------------------------------------- lifecycle

    def stats(self) -> dict[str, Any]:
        """Prompt tokens served per tier (``hits``: gpu, cpu, ssd, remote) and computed,
        tokens generated, copy-on-write copies, step times, the pool's use, and the
        tiered cache's own counters (``cache``)."""
        m = self.cache.manager
        return {
            "hits": dict(self._hits),
            **self._counters,
            "pool": {"num_blocks": m.num_blocks, "free_blocks": m.num_free_blocks, "cached_blocks": m.num_cached_blocks},
            "cache": self.cache.stats(),
        }

    def close(self) -> None:
        """Store the pool's blocks to the SSD tier (a restart serves them) and release the tiers."""
        self.cache.close()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _load_config(config: KVStrataConfig | str | Path | Mapping[str, Any] | None) -> KVStrataConfig:
    if isinstance(config, KVStrataConfig):
        return config
    if isinstance(config, (str, Path)):
        return KVStrataConfig.from_yaml(config)
    return KVStrataConfig.from_dict(config)


def _activation_dtype(dtype: str | torch.dtype | None, shape: ModelShape) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        name = _name(dtype)
    else:
        name = DTYPES.get(str(dtype or shape.dtype), "")
    if name not in ("float32", "float16", "bfloat16"):
        raise ConfigError(f"dtype: {dtype!r} is not one of float32, float16, bfloat16")
    return getattr(torch, name)


def _kv_name(cfg: KVStrataConfig, kv_cache_dtype: str | None, activation: torch.dtype) -> str:
    """The KV dtype's name: the argument, else ``model.kv_dtype`` when set, else the activations'."""
    configured = cfg.model.kv_dtype if "model.kv_dtype" in cfg.explicit else None
    if kv_cache_dtype is not None and configured is not None and \
            cache_dtype(kv_cache_dtype, activation) != cache_dtype(configured, activation, "model.kv_dtype"):
        raise ConfigError(f"model.kv_dtype: {configured} in the config, but kv_cache_dtype={kv_cache_dtype!r}")
    name = kv_cache_dtype or configured or "auto"
    return _name(activation) if name == "auto" else name


def _engine_config(cfg: KVStrataConfig, shape: ModelShape, kv_name: str) -> KVStrataConfig:
    """``cfg`` with ``model.*`` describing the checkpoint; a value the config set must agree."""
    if cfg.block_size not in BLOCK_SIZES:
        raise ConfigError(f"block_size: {cfg.block_size} is not supported by the paged-attention kernels "
                          f"({', '.join(map(str, BLOCK_SIZES))})")
    if shape.head_size not in HEAD_SIZES:
        raise ConfigError(f"model: head size {shape.head_size} is not supported by the paged-attention kernels "
                          f"({', '.join(map(str, HEAD_SIZES))})")
    cfg.reject(["model.block_nbytes"], "the engine's pool layout decides a block's size")
    derived = {"layers": shape.num_layers, "kv_heads": shape.num_kv_heads, "head_size": shape.head_size}
    for key, value in derived.items():
        if f"model.{key}" in cfg.explicit and getattr(cfg.model, key) != value:
            raise ConfigError(f"model.{key}: {getattr(cfg.model, key)} in the config, but the checkpoint has {value}")
    model = dataclasses.replace(cfg.model, kv_dtype=kv_name, **derived)
    return dataclasses.replace(cfg, model=model)
