"""The tier policy's memory per SSD block, and its start-up with a full SSD tier.

* bytes per block: a policy whose SSD tier holds ``n`` blocks (the plugin's
  scheduler half holds one such policy), measured with ``tracemalloc`` after
  seeding, for the flat-array index large disks get (``CompactIndex``) and the
  dict-based one (``SlotIndex``) side by side; the keys themselves (``bytes``
  the caller owns) are not counted, the index's own copies are. Keys are 32
  bytes (``hash: sha256`` / ``sha256_cbor``) or, with ``--key-bytes 16``, the
  16 of ``hash: xxh3_128``;
* seeding: ``TierPolicy.seed_store`` of ``n`` keys (what the scheduler half does
  at start-up with the keys every rank's tier holds), seconds;
* the scheduler half's memory per SSD block once ``n`` blocks were stored in
  this run (``--steady``): its policy and the lifecycle it keeps for the
  ``kv_block_*`` histograms, which holds each followed block's key and two
  times; the keys are made inside the measurement and dropped by the caller,
  as finished requests drop theirs. Every block followed, against the
  sampling the scheduler uses (``kvstrata.core.metrics.lifecycle_sampling``).

    .venv/bin/python benchmarks/scale_policy.py [--blocks 100000 1000000] [--key-bytes 32] [--steady]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import time
import tracemalloc

from kvstrata.policy import PolicySpec, TierPolicy
from kvstrata.policy import holdings


def _keys(n: int, width: int = 32) -> list[bytes]:
    return [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=width).digest() for i in range(n)]


def _policy(n: int, compact: bool) -> TierPolicy:
    saved = holdings.COMPACT_ABOVE
    holdings.COMPACT_ABOVE = 0 if compact else 1 << 62
    try:
        return TierPolicy(PolicySpec(slab_slots=1024, store_slots=n))
    finally:
        holdings.COMPACT_ABOVE = saved


def policy_memory(blocks: tuple[int, ...] = (100_000, 1_000_000), key_bytes: int = 32) -> list[dict]:
    """Bytes per held SSD block and seeding seconds, per index kind and size."""
    out = []
    for n in blocks:
        keys = _keys(n, key_bytes)
        for compact in (True, False):
            gc.collect()
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            policy = _policy(n, compact)
            t0 = time.perf_counter()
            dropped = policy.seed_store(keys)
            seconds = time.perf_counter() - t0
            held = tracemalloc.get_traced_memory()[0] - base
            tracemalloc.stop()
            assert not dropped and policy.occupancy()["ssd"] == n
            t0 = time.perf_counter()
            policy = _policy(n, compact)
            policy.seed_store(keys)  # untraced: tracemalloc slows every allocation
            plain = time.perf_counter() - t0
            out.append({"blocks": n, "key_bytes": key_bytes, "index": "CompactIndex" if compact else "SlotIndex",
                        "bytes_per_block": held / n, "seed_seconds": plain, "seed_seconds_traced": seconds})
            del policy
    return out


def steady_memory(blocks: tuple[int, ...] = (1_000_000,), key_bytes: int = 32) -> list[dict]:
    """Bytes per SSD block the scheduler half keeps after storing ``n`` blocks: its policy
    with the lifecycle recorder it runs, every block followed or sampled."""
    from kvstrata.core.metrics import Lifecycle, LifecycleRecorder, lifecycle_sampling

    out = []
    for n in blocks:
        for every in (1, lifecycle_sampling(n)):
            gc.collect()
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            lifecycle = {"cpu": Lifecycle(), "ssd": Lifecycle(sample_every=every)}
            policy = TierPolicy(PolicySpec(slab_slots=0, store_slots=n), observers=[LifecycleRecorder(lifecycle)])
            for lo in range(0, n, 256):  # a step's stores
                batch = _keys_from(lo, min(n, lo + 256), key_bytes)
                policy.complete_store(policy.prepare_store(list(range(len(batch))), batch, "computed"))
                del batch
            held = tracemalloc.get_traced_memory()[0] - base
            tracemalloc.stop()
            assert policy.occupancy()["ssd"] == n
            out.append({"blocks": n, "key_bytes": key_bytes, "sample_every": every, "bytes_per_block": held / n,
                        "followed": len(lifecycle["ssd"]._born)})
            del policy, lifecycle
    return out


def _keys_from(lo: int, hi: int, width: int) -> list[bytes]:
    return [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=width).digest() for i in range(lo, hi)]


def steady_table(rows: list[dict]) -> str:
    lines = ["| SSD blocks stored | key bytes | lifecycle follows | blocks followed | bytes per block |",
             "|---|---|---|---|---|"]
    for r in rows:
        follows = "every block" if r["sample_every"] == 1 else f"1 in {r['sample_every']}"
        lines.append(f"| {r['blocks']:,} | {r['key_bytes']} | {follows} | {r['followed']:,} | "
                     f"{r['bytes_per_block']:.1f} |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = ["| SSD blocks held | key bytes | index | bytes per block | seed_store seconds |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['blocks']:,} | {r['key_bytes']} | {r['index']} | {r['bytes_per_block']:.1f} "
                     f"| {r['seed_seconds']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--key-bytes", type=int, choices=(16, 32), default=32,
                    help="32: hash sha256 / sha256_cbor; 16: hash xxh3_128")
    ap.add_argument("--steady", action="store_true",
                    help="the scheduler's memory per block after storing them (policy and lifecycle)")
    args = ap.parse_args()
    if args.steady:
        print(steady_table(steady_memory(tuple(args.blocks), args.key_bytes)))
    else:
        print(table(policy_memory(tuple(args.blocks), args.key_bytes)))


if __name__ == "__main__":
    main()
