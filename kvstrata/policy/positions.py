"""How far into prompts a block reaches, and what computing it again costs there.

A block's key is the hash of its whole prefix, so a key has one position: the
block index ``p`` at which every prompt holding it holds it. The ``cost``
eviction order (:mod:`kvstrata.policy.cost_eviction`) weighs blocks by what
recomputing them costs, which grows with ``p``:

Computing block ``p`` (``bt`` tokens after ``p x bt`` others) takes, per token,
the weights' FLOPs (``2 P`` for ``P`` parameters) and attention over the context
(``4 L d`` per context token for ``L`` layers of width ``d``; each token of the
block attends ``p x bt`` earlier tokens and, on average, half the block's
own). So

    F(p) = bt x 2P x (1 + rho x bt x (p + 1/2)),   rho = 2 L d / P

FLOPs, where ``rho`` is the attention's share per context token. Every block
of a tier has the same bytes, so a block's FLOPs per byte, the efficiency
Marconi (Pan et al., MLSys'25) weighs, is proportional to the *weight*
``w(p) = 1 + rho x bt x (p + 1/2)``. ``rho`` is, in the order of preference:

* measured: the engine's seconds per token attended over its seconds per token
  (the vLLM connector fits both from its steps: :mod:`kvstrata.core.costs`);
* ``load.attention_rate`` and ``load.prefill_rate`` given: their ratio;
* else the model's: with ``P ~ 12 L d^2`` (a layer's attention and MLP
  weights), ``rho ~ 1 / (6 d)``, and ``d`` taken as four times the KV width
  (``kv_heads x head_size``: grouped-query attention's usual 4:1). For
  Llama-3-8B that is ``1 / 24,576`` against ``1 / 27,000`` from its real
  sizes.

**Reach, not position.** A prefix hit needs every block before it: a block
whose prefix left the tier is never hit again. Marconi evicts only the leaves of
its radix tree, so a node never leaves before the nodes below it, and a leaf's
efficiency is what decides. A flat tier has no tree; instead a block is weighed
at its *reach*: the deepest block of the last prompt that held it, ``w(reach)``.
A prompt's blocks then share one weight, and a prefix many prompts share is
weighed as the deepest of them, as the leaves below it are; within one weight,
recency decides, as it does for LRU.

Reaches are learnt from lookups: the driver notes every prompt's keys
(:meth:`Positions.note`). A key the book does not know (a decode block stored
before any prompt named it, a block the SSD tier held across a restart) takes
the mean noted reach until a lookup names it. The book keeps the keys of the
last ``limit`` to ``2 x limit`` noted blocks (two generations of plain dicts:
O(1), no per-key order), enough to span a key's time between its lookup and its
store or eviction from the device; an order keeps the reach of its own entries
and notes a victim's again as it leaves, for the tier its eviction cascades to.

Threading: the policy's owner thread.
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["Positions", "CLASSES", "default_rho", "flops_per_token", "prefix_weight"]

CLASSES = 24  # weight classes: a quarter octave of w each, up to w = 64 (above: the last class)


def default_rho(kv_heads: int, head_size: int) -> float:
    """The attention's share per context token from the KV layout (see the module docstring)."""
    return 1.0 / (6.0 * 4 * max(1, kv_heads * head_size))


def flops_per_token(layers: int, kv_heads: int, head_size: int) -> float:
    """The weights' FLOPs per token, ``2 P``, with ``P ~ 12 L d^2`` and ``d`` four times the
    KV width (see the module docstring): an estimate from the KV layout alone."""
    d = 4 * max(1, kv_heads * head_size)
    return 2.0 * 12 * max(1, layers) * d * d


def prefix_weight(blocks: int, rho: float, block_tokens: int) -> float:
    """``sum of w(p) for p < blocks``: the compute of a prompt's first ``blocks`` blocks in
    blocks without context (``blocks + rho x bt x blocks^2 / 2``)."""
    return blocks + rho * block_tokens * blocks * blocks / 2


class Positions:
    """The book of key reaches and the weight classes of the ``cost`` order."""

    def __init__(self, block_tokens: int, rho: float, limit: int = 1 << 17) -> None:
        self._block_tokens = max(1, int(block_tokens))
        self._rho = float(rho)
        self._classes: dict[int, int] = {}  # position -> class, until rho or the block size changes
        self.limit = max(1, int(limit))
        self._new: dict[bytes, int] = {}
        self._old: dict[bytes, int] = {}
        self._sum = 0.0  # decayed sum and count of noted positions: the default
        self._n = 0.0

    @property
    def rho(self) -> float:
        """The attention's share per context token (see the module docstring)."""
        return self._rho

    @rho.setter
    def rho(self, value: float) -> None:
        """A share that is not finite and non-negative (an absurd measurement) is ignored."""
        if value != self._rho and math.isfinite(value) and 0 <= value < 1e6:
            self._rho, self._classes = float(value), {}

    @property
    def block_tokens(self) -> int:
        return self._block_tokens

    @block_tokens.setter
    def block_tokens(self, value: int) -> None:
        if value != self._block_tokens:
            self._block_tokens, self._classes = max(1, int(value)), {}

    def note(self, keys: Sequence[bytes], count: int | None = None) -> None:
        """The first ``count`` of ``keys`` (all: None) are a prompt's blocks from its first:
        each reaches its last, block ``count - 1``."""
        n = len(keys) if count is None else min(count, len(keys))
        if n <= 0:
            return
        self._new.update(dict.fromkeys(keys[:n] if n < len(keys) else keys, n - 1))
        self._sum = self._sum * 0.999 + n - 1
        self._n = self._n * 0.999 + 1
        if len(self._new) >= self.limit:
            self._old, self._new = self._new, {}

    def keep(self, key: bytes, reach: int) -> None:
        """Note one key again (a victim on its way to the next tier)."""
        self._new[key] = reach
        if len(self._new) >= self.limit:
            self._old, self._new = self._new, {}

    def of(self, key: bytes) -> int | None:
        """The reach of ``key``, None when the book does not know it."""
        p = self._new.get(key)
        return self._old.get(key) if p is None else p

    def weight(self, position: int) -> float:
        """``w(p)``: recomputing block ``position`` against a block with no context."""
        return 1.0 + self.rho * self.block_tokens * (position + 0.5)

    def klass(self, key: bytes) -> tuple[int, int]:
        """The weight class of ``key``, ``floor(4 log2 w(reach))`` capped at ``CLASSES - 1``, and
        its reach (-1: unknown, the mean noted reach stands in)."""
        known = self._new.get(key)
        if known is None:
            known = self._old.get(key)
        p = known if known is not None else int(self._sum / self._n) if self._n else 0
        klass = self._classes.get(p)
        if klass is None:
            w = self.weight(p)
            klass = self._classes[p] = min(CLASSES - 1, int(4 * math.log2(w))) if w > 1 else 0
            if len(self._classes) > 1 << 16:
                self._classes = {}
        return klass, -1 if known is None else known
