"""The remote tier's throughput against raw GET/SET of the same values on the same server.

    .venv/bin/python benchmarks/bench_remote.py [--quick] [--url redis://host:port/0]

Without ``--url`` a local ``valkey-server`` is started (tests/valkey_server.py: no
persistence, ``maxmemory`` above the data, ``allkeys-lru``) on a loopback port.

* put: ``RemoteTier.put`` of every block, then ``flush()`` (encode, pipelined
  ``SET NX`` in batches of ``batch_bytes``), against a redis-py pipeline of ``SET`` of
  the very values kvstrata stores, in batches of the same size (target >= 0.7); and
  against the same pipeline sending a copy of each block taken when it is queued,
  the least a write-behind client does (the block's slot is reused once ``put``
  returns; kvstrata's put also makes that copy).
* get: ``RemoteTier.get_into`` (pipelined ``STRLEN`` + bounded ``GETRANGE``, MAC,
  header and checksum verified, decoded into rows) against a redis-py pipeline of
  ``GET`` of the same keys in the same batches (target >= 0.7).

Each case runs unsigned (``remote.trust_server``) and signed (the default: a keyed
HMAC-SHA256 on every value) side by side, so the MAC's cost is the change in ratio.

Both use one connection from this process; the server runs on this machine, so both
sides share its cores. Blocks are KV-like fp16 (``bench_tiers.kv_blocks``); with
``compression: none`` the two move the same bytes, with ``auto`` kvstrata moves fewer.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_tiers import kv_blocks  # noqa: E402

MiB = 1024**2


def best(fn: Callable[[], object], repeat: int, before: Callable[[], object] = lambda: None) -> float:
    out = float("inf")
    for _ in range(repeat):
        before()
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def run(url: str, layers: int, blocks: int, compression: str, repeat: int, signed: bool) -> None:
    import redis

    from kvstrata.tiers.remote import RemoteTier, key_prefix
    from kvstrata.tiers.remote.value import Auth, encode

    rows = kv_blocks(blocks, layers=layers)
    nb = rows.shape[1]
    keys = [i.to_bytes(32, "big") for i in range(blocks)]
    auth = Auth([b"bench-remote-secret-0123456789"]) if signed else None
    tier = RemoteTier(url, key_prefix(f"bench-{compression}-{nb}", signed=signed), nb, compression=compression,
                      timeout=5.0, queue_capacity_bytes=2 * rows.nbytes,  # the whole run fits: nothing is dropped
                      auth=auth)
    raw = redis.Redis.from_url(url, socket_timeout=30)
    values = [encode(tier.key(k), r.tobytes(), tier.codec, auth) for k, r in zip(keys, rows)]
    ref_keys = [b"raw:" + k for k in keys]
    step = tier.batch_values

    def clear() -> None:
        raw.flushdb()

    def raw_set() -> None:
        for lo in range(0, blocks, step):
            pipe = raw.pipeline(transaction=False)
            for k, v in zip(ref_keys[lo:lo + step], values[lo:lo + step]):
                pipe.set(k, v)
            pipe.execute()

    def raw_set_copied() -> None:
        for lo in range(0, blocks, step):
            pipe = raw.pipeline(transaction=False)
            for k, r in zip(ref_keys[lo:lo + step], rows[lo:lo + step]):
                pipe.set(k, bytearray(r))
            pipe.execute()

    def raw_get() -> None:
        for lo in range(0, blocks, step):
            pipe = raw.pipeline(transaction=False)
            for k in ref_keys[lo:lo + step]:
                pipe.get(k)
            pipe.execute()

    def tier_put() -> None:
        for k, r in zip(keys, rows):
            tier.put(k, r)
        tier.flush()

    out = np.empty_like(rows)

    def tier_get() -> None:
        got = tier.get_into(keys, out)
        assert got == blocks, (got, tier.stats())

    total = rows.nbytes / 1e9
    put_s = best(tier_put, repeat, clear)
    set_s = best(raw_set, repeat, clear)
    copied_s = best(raw_set_copied, repeat, clear) if compression == "none" else None
    raw_set()
    tier_put()
    get_s = best(tier_get, repeat)
    rget_s = best(raw_get, repeat)
    assert np.array_equal(out, rows)
    stored = sum(len(v) for v in values) / rows.nbytes
    print(f"  {nb // 1024:5d} KiB blocks, compression {compression:<4}, {'signed' if signed else 'unsigned'} "
          f"(stored {stored:.2f} of raw):")
    for name, mine, ref in (("put + flush", put_s, set_s), ("get_into", get_s, rget_s)):
        ratio = ref / mine
        print(f"    {name:<12} {total / mine:6.2f} GB/s of blocks   raw {'SET' if 'put' in name else 'GET'} "
              f"{total / ref:6.2f} GB/s   ratio {ratio:5.2f} >= 0.7{'  ok' if ratio >= 0.7 else '  BELOW TARGET'}")
    if copied_s is not None:
        print(f"    {'put + flush':<12} vs raw SET of a copy of each block (write-behind's least) "
              f"{total / copied_s:6.2f} GB/s   ratio {copied_s / put_s:5.2f}")
    tier.close()
    raw.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="an existing server (its database is flushed!); default: start valkey-server")
    ap.add_argument("--quick", action="store_true", help="fewer blocks and repeats (a smoke run)")
    args = ap.parse_args(argv)
    blocks, repeat = (32, 2) if args.quick else (256, 5)
    server = None
    if args.url is None:
        from valkey_server import ValkeyServer

        server = ValkeyServer(maxmemory="4gb")
    url = args.url or server.url
    try:
        print(f"remote tier vs raw pipelines on {url} ({blocks} blocks per run, best of {repeat})")
        for layers in (2, 16):  # 256 KiB and 2 MiB blocks
            for compression in ("none", "auto"):
                for signed in (False, True):  # side by side: the MAC's cost is the ratio's change
                    run(url, layers, blocks, compression, repeat, signed)
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
