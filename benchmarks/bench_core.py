"""Core benchmark: hash-chain throughput, BlockManager allocate+commit+free throughput, and
the per-operation cost of each tier eviction order (``lru``, ``s3fifo``, ``arc``) side by side.

Prints kvstrata's figures next to vLLM's own code measured in the same run (when
vLLM is importable): ``hash_block_tokens`` with sha256 for hashing, and vLLM's
``FreeKVCacheBlockQueue`` for the free-queue operations the block pool is made of.

    python benchmarks/bench_core.py [--repeat N]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Callable

from kvstrata import BlockHasher, BlockManager
from kvstrata.pool.blocks import Block, FreeBlockQueue

PROMPT = list(range(1000, 1000 + 8192))
BS = 16


def best_of(fn: Callable[[], object], repeat: int) -> float:
    return best_interleaved([fn], repeat)[0]


def best_interleaved(fns: list[Callable[[], object]], repeat: int) -> list[float]:
    """Best time of each function, alternating them so machine noise hits all alike."""
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def vllm_hasher() -> Callable[[], object] | None:
    try:
        import vllm.v1.core.kv_cache_utils as k
        from vllm.utils.hashing import sha256
    except Exception:
        return None
    k.init_none_hash(sha256)

    def run() -> list:
        parent, out = k.NONE_HASH, []
        for i in range(0, len(PROMPT) - BS + 1, BS):
            parent = k.hash_block_tokens(sha256, parent, PROMPT[i:i + BS], None)
            out.append(parent)
        return out

    return run


def chat_workload(n_requests: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    rng = random.Random(seed)
    system = list(range(50_000, 50_000 + 512))
    users: dict[int, list[int]] = {}
    out = []
    for i in range(n_requests):
        u = rng.randrange(64)
        hist = users.setdefault(u, system + [rng.randrange(32000) for _ in range(rng.randint(50, 300))])
        out.append((f"r{i}", list(hist)))
        hist += [rng.randrange(32000) for _ in range(rng.randint(50, 300))]
        if len(hist) > 4000:
            users.pop(u)
    return out


def bench_manager(workload: list[tuple[str, list[int]]]) -> tuple[float, int]:
    m = BlockManager(4096, BS)
    blocks = 0
    t0 = time.perf_counter()
    for rid, toks in workload:
        blocks += len(m.allocate(rid, toks).block_ids)
        m.commit(rid)
        m.free(rid)
    return time.perf_counter() - t0, blocks


def bench_queue_ops(make_queue: Callable[[int], tuple[object, list]], n: int = 100_000) -> float:
    q, blocks = make_queue(n)
    t0 = time.perf_counter()
    for i in range(0, n, 2):  # remove from the middle (a hit) and put back at the tail (a free)
        q.remove(blocks[i])
        q.append(blocks[i])
    for _ in range(n):
        q.popleft()
    return (time.perf_counter() - t0) / (2 * n)


def kvstrata_queue(n: int):
    blocks = [Block(i) for i in range(n)]
    return FreeBlockQueue(blocks), blocks


def vllm_queue(n: int):
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

    blocks = [KVCacheBlock(i) for i in range(n)]
    return FreeKVCacheBlockQueue(blocks), blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    nblocks = len(PROMPT) // BS
    ours = BlockHasher(BS, "sha256", namespace="bench")
    vl = vllm_hasher()
    if vl is not None:
        t_ours, t_vllm = best_interleaved([lambda: ours.hash_blocks(PROMPT), vl], args.repeat)
    else:
        t_ours = best_of(lambda: ours.hash_blocks(PROMPT), args.repeat)
    print(f"hash sha256 chain, 8192-token prompt ({nblocks} blocks of {BS}):")
    print(f"  kvstrata            {nblocks / t_ours / 1e6:6.3f} M blocks/s  ({t_ours * 1e3:.3f} ms/prompt)")
    for algo in ("xxh3_128", "sha256_cbor"):
        h = BlockHasher(BS, algo)
        t = best_of(lambda: h.hash_blocks(PROMPT), max(3, args.repeat // 3))
        print(f"  kvstrata {algo:<10} {nblocks / t / 1e6:6.3f} M blocks/s  ({t * 1e3:.3f} ms/prompt)")
    if vl is not None:
        print(f"  vLLM sha256       {nblocks / t_vllm / 1e6:6.3f} M blocks/s  ({t_vllm * 1e3:.3f} ms/prompt)")
        print(f"  ratio kvstrata/vLLM sha256 blocks/s: {t_vllm / t_ours:.2f}x (target >= 2x)")
    else:
        print("  vLLM not importable: no side-by-side hash figure")

    work = chat_workload(2000)
    runs = [bench_manager(work) for _ in range(3)]
    t, blocks = min(runs)
    print(f"BlockManager allocate+commit+free, chat workload ({len(work)} requests, {blocks} blocks):")
    print(f"  {len(work) / t:,.0f} requests/s, {blocks / t / 1e6:.2f} M blocks/s (hashing included)")
    pairs = [(bench_queue_ops(kvstrata_queue), bench_queue_ops(vllm_queue) if vl else 0.0) for _ in range(5)]
    qt = statistics.median(p[0] for p in pairs)
    print(f"free queue remove+append+popleft: kvstrata {qt * 1e9:.0f} ns/op")
    if vl is not None:
        qv = statistics.median(p[1] for p in pairs)
        print(f"                                  vLLM   {qv * 1e9:.0f} ns/op  (ratio vLLM/kvstrata time {qv / qt:.2f}x)")

    from kvstrata.policy.order_overhead import policy_ns_per_op
    from kvstrata.system.values import EVICTIONS

    print("tier eviction orders, SlotIndex of 65,536 slots, 200,000 skewed lookups (touch or place), best of 3:")
    cost = {ev: min(policy_ns_per_op(ev, seed=r) for r in range(3)) for ev in EVICTIONS}
    for ev, ns in cost.items():
        print(f"  {ev:<7} {ns:6.0f} ns/op  ({ns / cost['lru']:.2f}x lru; target <= 2x)")

    from kvstrata.core.costs import MEASURED, LoadCosts

    costs = LoadCosts(("cpu", "ssd"), policy=MEASURED, block_seconds={"cpu": 1e-4, "ssd": 4e-3}, token_seconds=1e-4)
    for cpu, ssd in ((24, 40), (200, 312)):  # a DRAM prefix and an SSD tail: 1K and 8K tokens of 16
        hit = ["cpu"] * cpu + ["ssd"] * ssd
        t = best_of(lambda: costs.worth(hit, BS), repeat=2000)
        print(f"load or recompute, one decision over a {len(hit)}-block hit in two tiers: {t * 1e6:.2f} us "
              f"(target < 5 us)")


if __name__ == "__main__":
    main()
