"""Seeded synthetic workloads: multi-turn chat, RAG over a shared document set, agents.

A prompt is a list of *segments* ``(segment_id, num_tokens)``: equal segment
ids stand for equal text. Full blocks are chained to their parent the way an
engine hashes tokens, so two prompts share blocks exactly as long as they
share a token prefix; the last prompt token is always computed.

Shapes (an hour of traffic, sized so that the default deployment of ``kvstrata
bench`` sees hits from every tier of the mixed workload):

``chat``
    conversations on one of a few system prompts; each turn's prompt is the
    whole conversation so far plus a new user message; the user thinks for
    seconds to many minutes between turns (lognormal, median 2.5 minutes).
``rag``
    a shared instruction, then three documents retrieved from a set of 4,000
    with Zipf popularity, then a question.
``agent``
    ten agents with long fixed system prompts (tool descriptions); each task
    runs several steps, every step appending an action and a tool
    observation.
``mixed``
    all three at once.
"""

from __future__ import annotations

import itertools
import random
from typing import Callable, Iterator

from kvstrata.trace.reader import Trace, TraceBuilder

__all__ = ["WORKLOADS", "DEFAULT_WORKLOAD", "generate"]

WORKLOADS = ("chat", "rag", "agent", "mixed")
DEFAULT_WORKLOAD = "mixed"

# An hour of traffic on the default deployment (kvstrata.bench.deployment): every tier serves hits.
CHAT_SESSIONS, THINK_S = 300, (5.0, 1.3)   # lognormal think time: median 2.5 min, 1 in 10 over 13 min
RAG_DOCS, RAG_QUERIES = 4000, 1500
AGENTS, AGENT_TASKS = 10, 80
DURATION_S = 3600.0

Segments = list[tuple[int, int]]
Event = tuple[float, Segments, int]   # (arrival s, prompt segments, output tokens)


class _Ids:
    """Fresh segment ids."""

    def __init__(self) -> None:
        self._next = itertools.count(1)

    def __call__(self) -> int:
        return next(self._next)


def _chat(rng: random.Random, new: _Ids, scale: float, duration: float) -> Iterator[Event]:
    systems = [(new(), rng.randint(150, 500)) for _ in range(3)]
    for _ in range(int(CHAT_SESSIONS * scale)):
        t = rng.uniform(0, duration)
        prompt: Segments = [rng.choice(systems)]
        for _ in range(rng.randint(2, 8)):
            prompt = prompt + [(new(), rng.randint(20, 250))]
            out = rng.randint(30, 300)
            yield t, prompt, out
            prompt = prompt + [(new(), out)]
            t += out * 0.02 + rng.lognormvariate(*THINK_S)  # reading and typing: seconds to many minutes


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1 / (k ** s) for k in range(1, n + 1)]


def _rag(rng: random.Random, new: _Ids, scale: float, duration: float) -> Iterator[Event]:
    instruction = (new(), 120)
    docs = [(new(), rng.randint(200, 700)) for _ in range(RAG_DOCS)]
    weights = _zipf_weights(len(docs), 1.1)
    for _ in range(int(RAG_QUERIES * scale)):
        picked: Segments = []
        while len(picked) < 3:
            d = rng.choices(docs, weights)[0]
            if d not in picked:
                picked.append(d)
        yield rng.uniform(0, duration), [instruction, *picked, (new(), rng.randint(15, 60))], rng.randint(20, 150)


def _agent(rng: random.Random, new: _Ids, scale: float, duration: float) -> Iterator[Event]:
    systems = [(new(), rng.randint(1500, 3000)) for _ in range(AGENTS)]
    for _ in range(int(AGENT_TASKS * scale)):
        t = rng.uniform(0, duration)
        prompt: Segments = [rng.choice(systems), (new(), rng.randint(40, 200))]
        for _ in range(rng.randint(3, 9)):
            out = rng.randint(20, 120)
            yield t, prompt, out
            prompt = prompt + [(new(), out), (new(), rng.randint(50, 400))]
            t += out * 0.02 + rng.uniform(0.5, 4)


_SHAPES: dict[str, list[tuple[Callable[..., Iterator[Event]], float]]] = {
    "chat": [(_chat, 2.0)],
    "rag": [(_rag, 2.0)],
    "agent": [(_agent, 2.0)],
    "mixed": [(_chat, 1.0), (_rag, 1.0), (_agent, 1.0)],
}


def _blocks(b: TraceBuilder, segments: Segments) -> tuple[list[int], int]:
    """Chained block ids of the prompt's full blocks, and its token count."""
    bs = b.block_size
    blocks: list[int] = []
    parent, pieces, fill, total = -1, [], 0, 0
    for seg, n in segments:
        total += n
        off = 0
        while off < n:
            take = min(bs - fill, n - off)
            pieces.append((seg, off, take))
            fill += take
            off += take
            if fill == bs:
                parent = b.intern((parent, tuple(pieces)))
                blocks.append(parent)
                pieces, fill = [], 0
    return blocks, total


def generate(name: str = DEFAULT_WORKLOAD, seed: int = 0, *, block_size: int = 16, scale: float = 1.0,
             duration_s: float = DURATION_S) -> Trace:
    """A seeded workload as a :class:`Trace` (``scale`` multiplies the number of sessions)."""
    if name not in _SHAPES:
        raise ValueError(f"--workload: expected one of {', '.join(WORKLOADS)}; got {name!r}")
    if scale <= 0:
        raise ValueError(f"scale: must be positive, got {scale}")
    rng = random.Random(seed)
    new = _Ids()
    events: list[Event] = []
    for shape, weight in _SHAPES[name]:
        events.extend(shape(rng, new, weight * scale / 2, duration_s))
    events.sort(key=lambda e: e[0])
    b = TraceBuilder(f"workload:{name}(seed={seed})", "workload", block_size)
    for ts, segments, out in events:
        blocks, n = _blocks(b, segments)
        b.add_blocks(ts, blocks, n, out, min(len(blocks), (n - 1) // block_size))
    return b.build()
