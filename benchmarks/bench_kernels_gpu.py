"""Kernel microbenchmarks on one GPU, as ratios against references measured in
the same run:
  paged attention (batch 64, context 4096, 32 query / 8 KV heads, head 128,
  block 16; bf16 cache and FP8 E4M3 cache): KV bytes read per second / the
  device-to-device copy bandwidth (read + write bytes per second of a large copy_);
  gather / scatter of 512 blocks x 32 layers x (K, V) to / from pinned host
  memory: bytes per second / a plain pinned cudaMemcpy of the same bytes.
Writes bench_kernels.json (and prints a table) to $OUT when set.

    python benchmarks/bench_kernels_gpu.py
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from kvstrata.kernels import gather_blocks, kv_cache_shapes, paged_attention, scatter_blocks

ATTN_TARGET, COPY_TARGET = 0.70, 0.80


def timed(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Median seconds per call, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def d2d_bandwidth(nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src))


def attention_case(cache_dtype: torch.dtype) -> dict[str, float]:
    batch, ctx, heads, kv_heads, head, block = 64, 4096, 32, 8, 128, 16
    blocks_per_seq = ctx // block
    num_blocks = batch * blocks_per_seq
    k_shape, v_shape = kv_cache_shapes(num_blocks, kv_heads, head, block, cache_dtype)
    kc = torch.randn(k_shape, device="cuda").to(cache_dtype)
    vc = torch.randn(v_shape, device="cuda").to(cache_dtype)
    tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(batch, blocks_per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, head, device="cuda").to(torch.bfloat16)
    out = torch.empty_like(q)
    kw = dict(k_scale=0.05, v_scale=0.05, out=out, max_seq_len=ctx, check_indices=False)
    seconds = timed(lambda: paged_attention(q, kc, vc, tables, lens, head**-0.5, **kw))
    kv_bytes = kc.numel() * kc.element_size() + vc.numel() * vc.element_size()
    return {"seconds": seconds, "bytes": kv_bytes, "bandwidth": kv_bytes / seconds}


def transfer_cases() -> dict[str, dict[str, float]]:
    layers, blocks, pool_blocks = 32, 512, 2048
    k_shape, v_shape = kv_cache_shapes(pool_blocks, 8, 128, 16, torch.bfloat16)
    caches = [torch.empty(s, dtype=torch.bfloat16, device="cuda") for _ in range(layers) for s in (k_shape, v_shape)]
    ids = torch.randperm(pool_blocks)[:blocks].cuda()
    row = sum(c[0].numel() * c.element_size() for c in caches)
    pinned = torch.empty(blocks, row, dtype=torch.uint8, pin_memory=True)
    contiguous = torch.empty(blocks * row, dtype=torch.uint8, device="cuda")
    flat_pinned = pinned.view(-1)
    nbytes = blocks * row
    res = {}
    for name, fn, ref in (
        ("gather_to_pinned", lambda: gather_blocks(caches, ids, pinned, check_indices=False),
         lambda: flat_pinned.copy_(contiguous, non_blocking=True)),
        ("scatter_from_pinned", lambda: scatter_blocks(pinned, caches, ids, check_indices=False),
         lambda: contiguous.copy_(flat_pinned, non_blocking=True)),
    ):
        t, t_ref = timed(fn, iters=10), timed(ref, iters=10)
        res[name] = {"seconds": t, "bytes": nbytes, "bandwidth": nbytes / t, "memcpy_bandwidth": nbytes / t_ref,
                     "ratio": t_ref / t, "target": COPY_TARGET}
    return res


def main() -> None:
    torch.manual_seed(0)
    results: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    out = os.environ.get("OUT")

    def save(state: str) -> None:  # after every case: a run cut short keeps what it measured
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / "bench_kernels.json").write_text(json.dumps({**results, "state": state}, indent=2))

    d2d = d2d_bandwidth()
    results["d2d_copy_bandwidth"] = d2d
    save("d2d")
    for label, dtype in (("attention_bf16", torch.bfloat16), ("attention_fp8_e4m3", torch.float8_e4m3fn)):
        r = attention_case(dtype)
        results[label] = {**r, "ratio": r["bandwidth"] / d2d, "target": ATTN_TARGET}
        save(label)
    results.update(transfer_cases())
    save("done")
    lines = [f"device: {results['device']}  d2d copy: {d2d / 1e9:.0f} GB/s (read+write)"]
    for key, r in results.items():
        if isinstance(r, dict):
            ok = "ok" if r["ratio"] >= r["target"] else "BELOW TARGET"
            lines.append(f"{key:22s} {r['bandwidth'] / 1e9:8.1f} GB/s  {r['seconds'] * 1e3:8.3f} ms  "
                         f"ratio {r['ratio']:.2f} (target {r['target']:.2f}) {ok}")
    print("\n".join(lines))
    if out:
        (Path(out) / "bench_kernels.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
