"""Speed of the SSD tier's compact index: placements, lookups and touches, best of 3.

300 ``allocate_many`` calls of 1,000 sha256 keys into 200,000 slots (the last
100,000 evict), then 300,000 ``in`` tests and 200,000 ``touch_many`` refreshes.

    .venv/bin/python benchmarks/bench_index.py
"""

from __future__ import annotations

import hashlib
import time

from kvstrata.policy.compact_index import CompactIndex


def main() -> None:
    keys = [hashlib.sha256(str(i).encode()).digest() for i in range(300_000)]
    best: dict[str, float] = {}
    for _ in range(3):
        index = CompactIndex(200_000)
        t = time.perf_counter()
        for i in range(0, len(keys), 1000):
            index.allocate_many(keys[i:i + 1000])
        timings = {"allocate": time.perf_counter() - t}
        t = time.perf_counter()
        sum(1 for k in keys if k in index)
        timings["contains"] = time.perf_counter() - t
        t = time.perf_counter()
        index.touch_many(keys[100_000:])
        timings["touch"] = time.perf_counter() - t
        for name, seconds in timings.items():
            best[name] = min(best.get(name, float("inf")), seconds)
    print({name: round(seconds, 3) for name, seconds in best.items()})


if __name__ == "__main__":
    main()
