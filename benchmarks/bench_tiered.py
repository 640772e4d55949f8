"""Time to serve a 4K-token prefix hit from each tier vs recomputing it.

A small Llama-like torch stack (float32 on CPU) prefills the prompt; its K/V
bytes are what the tiers store. Then, with the same TieredKVCache:

* gpu: the prefix is still in the device pool (bookkeeping only);
* cpu: the prefix was evicted from the pool into the CPU tier and is promoted;
* ssd: a new cache on the same SSD path (empty pool and CPU tier, pages of the
  LMDB file dropped from the page cache) reads, verifies and promotes it.

Each is printed as a ratio to the recompute time measured in the same run.

    python benchmarks/bench_tiered.py [--tokens 4096] [--layers 4] [--hidden 512]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.nn.functional as F

from benchutil import drop_page_cache
from kvstrata import KVStrataConfig, TieredKVCache

BS = 16


class Stack(torch.nn.Module):
    """Pre-norm decoder layers with GQA attention (enough to cost what prefill costs)."""

    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, hidden // heads
        self.layers = torch.nn.ModuleList()
        for _ in range(layers):
            self.layers.append(torch.nn.ModuleDict({
                "qkv": torch.nn.Linear(hidden, (heads + 2 * kv_heads) * self.hd, bias=False),
                "o": torch.nn.Linear(hidden, hidden, bias=False),
                "up": torch.nn.Linear(hidden, 4 * hidden, bias=False),
                "down": torch.nn.Linear(4 * hidden, hidden, bias=False),
                "n1": torch.nn.RMSNorm(hidden), "n2": torch.nn.RMSNorm(hidden)}))

    @torch.no_grad()
    def prefill(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Run the stack over ``x`` [T, hidden]; return per-layer K/V [T, 2, kv_heads, hd]."""
        T = x.shape[0]
        kvs = []
        for l in self.layers:
            q, k, v = l["qkv"](l["n1"](x)).split([self.heads * self.hd, self.kv_heads * self.hd,
                                                   self.kv_heads * self.hd], dim=-1)
            q = q.view(T, self.heads, self.hd).transpose(0, 1)
            k = k.view(T, self.kv_heads, self.hd).transpose(0, 1)
            v = v.view(T, self.kv_heads, self.hd).transpose(0, 1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + l["o"](a.transpose(0, 1).reshape(T, -1))
            x = x + l["down"](F.silu(l["up"](l["n2"](x))))
            kvs.append(torch.stack([k.transpose(0, 1), v.transpose(0, 1)], dim=1))
        return kvs


def kv_blocks(kvs: list[torch.Tensor], num_blocks: int) -> torch.Tensor:
    """Per-block bytes [num_blocks, block_nbytes]: all layers' K and V of the block's tokens."""
    per_block = [kv[: num_blocks * BS].reshape(num_blocks, -1) for kv in kvs]
    return torch.cat(per_block, dim=1).contiguous().view(torch.uint8).reshape(num_blocks, -1)


def serve(cache: TieredKVCache, rid: str, tokens: list[int]) -> tuple[float, dict[str, int]]:
    t0 = time.perf_counter()
    a = cache.allocate(rid, tokens)
    a.wait()
    dt = time.perf_counter() - t0
    cache.free(rid)
    return dt, a.hit_blocks


def measure_tiers(blocks: torch.Tensor) -> tuple[dict[str, float], tuple, dict]:
    """Serve the prefix once from each tier (fresh cache and SSD directory)."""
    nblocks, nbytes = blocks.shape
    tokens = list(range(7, 7 + nblocks * BS + 1))  # one extra token: the whole prefix may hit
    times: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-") as d:
        cfg = KVStrataConfig.from_dict({
            "block_size": BS, "model": {"block_nbytes": nbytes}, "gpu": {"num_blocks": nblocks + 8},
            "cpu": {"capacity": 2 * (nblocks + 8) * nbytes},
            "ssd": {"path": d, "capacity": 4 * (nblocks + 8) * nbytes}})
        with TieredKVCache(cfg) as cache:
            a = cache.allocate("first", tokens)
            cache.kv_pool[a.block_ids[:nblocks]] = blocks
            cache.commit("first")  # computed: stored below (on_compute admission, write-through)
            cache.free("first")
            times["gpu"], hits_gpu = serve(cache, "gpu", tokens)
            cache.allocate("evict", list(range(10**6, 10**6 + (nblocks + 8) * BS)))  # the prefix spills
            cache.free("evict")
            cache.flush()  # the write-through to SSD finishes first: measure the promotion alone
            times["cpu"], hits_cpu = serve(cache, "cpu", tokens)
            cache.flush()
            ssd_stats = cache.stats()["ssd"]
        drop_page_cache(d)
        with TieredKVCache(cfg) as fresh:
            times["ssd"], hits_ssd = serve(fresh, "ssd", tokens)
    return times, (hits_gpu, hits_cpu, hits_ssd), ssd_stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = Stack(args.layers, args.hidden, args.heads, args.kv_heads).eval()
    x = torch.randn(args.tokens, args.hidden)
    recompute = min(_timed(lambda: model.prefill(x)) for _ in range(args.repeat))
    nblocks = args.tokens // BS
    blocks = kv_blocks(model.prefill(x), nblocks)
    nbytes = blocks.shape[1]
    runs = [measure_tiers(blocks) for _ in range(args.repeat)]
    times = {t: min(r[0][t] for r in runs) for t in ("gpu", "cpu", "ssd")}
    hits_gpu, hits_cpu, hits_ssd = runs[0][1]
    ssd_stats = runs[0][2]
    mib = nblocks * nbytes / 2**20
    print(f"prefix: {args.tokens} tokens = {nblocks} blocks x {nbytes // 1024} KiB = {mib:.0f} MiB "
          f"({args.layers} layers, hidden {args.hidden}, {args.kv_heads} KV heads, fp32)")
    print(f"recompute (prefill through the stack): {recompute * 1e3:8.1f} ms")
    for tier, hits in (("gpu", hits_gpu), ("cpu", hits_cpu), ("ssd", hits_ssd)):
        assert hits[tier] == nblocks, (tier, hits)
        gbs = mib / 1024 / times[tier] if tier != "gpu" else float("nan")
        print(f"hit from {tier}: {times[tier] * 1e3:8.1f} ms  = {times[tier] / recompute:.3f}x recompute"
              + (f"  ({gbs:.2f} GB/s incl. hashing + lookup)" if tier != "gpu" else ""))
    print(f"SSD compression ratio on these K/V bytes: {ssd_stats['compression_ratio']:.3f}")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
