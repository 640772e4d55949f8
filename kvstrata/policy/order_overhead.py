"""What an eviction order costs the scheduler: nanoseconds per lookup-and-update.

A :class:`~kvstrata.policy.slot_index.SlotIndex` of 65,536 slots under the order
serves a skewed synthetic stream of 200,000 lookups (a touch on a hit, a
placement on a miss), in this process; under ``cost`` each key sits at a random
position of an 8K-token prompt. ``kvstrata bench --compare`` and
``benchmarks/bench_core.py`` report it beside LRU's.
"""

from __future__ import annotations

import random
import time

from kvstrata.policy.orders import OrderContext
from kvstrata.policy.positions import Positions
from kvstrata.policy.slot_index import SlotIndex
from kvstrata.policy.spec import DEFAULT_RHO

__all__ = ["policy_ns_per_op"]


def policy_ns_per_op(eviction: str, slots: int = 65_536, ops: int = 200_000, seed: int = 0) -> float:
    """Nanoseconds per lookup-and-update of a SlotIndex under ``eviction`` (see the module docstring)."""
    rng = random.Random(seed)
    keys = [rng.getrandbits(256).to_bytes(32, "little") for _ in range(4 * slots)]
    stream = [keys[min(int(rng.paretovariate(1.2)) - 1, len(keys) - 1)] if rng.random() < 0.7
              else keys[rng.randrange(len(keys))] for _ in range(ops)]
    context = OrderContext(reaches=Positions(16, DEFAULT_RHO, limit=len(keys) + 1))
    index = SlotIndex(slots, eviction, context)
    if context.learning:  # an order that weighs reaches: blocks at positions up to 512 (8K tokens of 16)
        book = context.reaches()
        for key in keys:
            book.keep(key, rng.randrange(512))
    t0 = time.perf_counter()
    for key in stream:
        if key in index:
            index.touch(key)
        else:
            index.try_allocate(key)
    return (time.perf_counter() - t0) * 1e9 / ops
