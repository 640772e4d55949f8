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

Each case runs unsigned (``remote.trust_server``), signed only (``remote.encrypt:
false``: a keyed HMAC-SHA256 on every value) and sealed (the default: AES-256-GCM)
side by side on the same server, so the cost of each is the change in ratio; the last
lines give sealed against signed-only, put and get, per case. ``--seal-vs-sign
ROUNDS`` measures only that, the two interleaved round by round (steadier on a busy
machine).

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


MODES = ("unsigned", "signed", "sealed")


def run(url: str, layers: int, blocks: int, compression: str, repeat: int, mode: str) -> tuple[float, float]:
    """One case; returns (put, get) in GB/s of blocks."""
    import redis

    from kvstrata.config.remote import RemoteConfig
    from kvstrata.tiers.remote import RemoteTier, key_prefix
    from kvstrata.tiers.remote.value import Auth, encode

    rows = kv_blocks(blocks, layers=layers)
    nb = rows.shape[1]
    keys = [i.to_bytes(32, "big") for i in range(blocks)]
    auth = Auth([b"bench-remote-Zp4-Rw8_Kq2mXv7Ld3Nb9Tc6"], encrypt=mode == "sealed") if mode != "unsigned" else None
    cfg = RemoteConfig(url=url, compression=compression,
                       timeout=5.0, queue_capacity=2 * rows.nbytes)  # the whole run fits: nothing is dropped
    tier = RemoteTier(cfg, key_prefix(f"bench-{compression}-{nb}-{mode}", signed=auth is not None), nb, auth=auth)
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
    print(f"  {nb // 1024:5d} KiB blocks, compression {compression:<4}, {mode:<8} "
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
    return total / put_s, total / get_s


def values_alone(layers: int, blocks: int, rounds: int) -> tuple[float, float]:
    """Sealing and opening against signing and verifying, uncompressed, without a server
    (the cost itself: what the writer and reader threads spend), interleaved, best of
    ``rounds``; returns the (write, read) ratios sealed / signed."""
    from kvstrata.tiers.remote.value import Auth, decode_into, seal, staged
    from kvstrata.tiers.ssd.record import Codec

    rows = kv_blocks(blocks, layers=layers)
    codec, out = Codec("none"), np.empty_like(rows[0])
    auths = {m: Auth([b"bench-remote-Zp4-Rw8_Kq2mXv7Ld3Nb9Tc6"], encrypt=m == "sealed") for m in ("signed", "sealed")}
    write = {m: float("inf") for m in auths}
    read = dict(write)
    for _ in range(rounds):
        for mode, auth in auths.items():
            bufs = [staged(r, None, auth) for r in rows]
            t0 = time.perf_counter()
            values = [seal(i.to_bytes(32, "big"), b, codec, auth) for i, b in enumerate(bufs)]
            write[mode] = min(write[mode], time.perf_counter() - t0)
            t0 = time.perf_counter()
            for i, v in enumerate(values):
                decode_into(i.to_bytes(32, "big"), v, out, codec, auth)
            read[mode] = min(read[mode], time.perf_counter() - t0)
    total = rows.nbytes / 1e9
    ratios = write["signed"] / write["sealed"], read["signed"] / read["sealed"]
    print(f"  {rows.shape[1] // 1024:5d} KiB blocks, values alone (no server): seal {total / write['sealed']:5.2f} GB/s, "
          f"sign {total / write['signed']:5.2f} GB/s = {ratios[0]:4.2f}x   open {total / read['sealed']:5.2f} GB/s, "
          f"verify {total / read['signed']:5.2f} GB/s = {ratios[1]:4.2f}x")
    return ratios


def seal_vs_sign(url: str, layers: int, blocks: int, compression: str, rounds: int) -> tuple[float, float]:
    """Sealed against signed-only values, interleaved round by round on one server (each
    round: both tiers' put + flush on an empty database, then both tiers' get_into), best
    of ``rounds`` each; returns the (put, get) ratios sealed / signed."""
    import redis

    from kvstrata.config.remote import RemoteConfig
    from kvstrata.tiers.remote import RemoteTier, key_prefix
    from kvstrata.tiers.remote.value import Auth

    rows = kv_blocks(blocks, layers=layers)
    nb = rows.shape[1]
    keys = [i.to_bytes(32, "big") for i in range(blocks)]
    secret = b"bench-remote-Zp4-Rw8_Kq2mXv7Ld3Nb9Tc6"
    cfg = RemoteConfig(url=url, compression=compression, timeout=30.0, queue_capacity=2 * rows.nbytes)
    tiers = {mode: RemoteTier(cfg, key_prefix(f"bench-{mode}-{compression}-{nb}"), nb,
                              auth=Auth([secret], encrypt=mode == "sealed")) for mode in ("signed", "sealed")}
    raw = redis.Redis.from_url(url, socket_timeout=30)
    out = np.empty_like(rows)
    put_s = {m: float("inf") for m in tiers}
    get_s = dict(put_s)
    for _ in range(rounds):
        for mode, tier in tiers.items():
            raw.flushdb()
            t0 = time.perf_counter()
            for k, r in zip(keys, rows):
                tier.put(k, r)
            tier.flush()
            put_s[mode] = min(put_s[mode], time.perf_counter() - t0)
        for mode, tier in tiers.items():
            raw.flushdb()
            for k, r in zip(keys, rows):
                tier.put(k, r)
            tier.flush()
            t0 = time.perf_counter()
            got = tier.get_into(keys, out)
            get_s[mode] = min(get_s[mode], time.perf_counter() - t0)
            assert got == blocks and np.array_equal(out, rows), (mode, got, tier.stats())
    total = rows.nbytes / 1e9
    ratios = put_s["signed"] / put_s["sealed"], get_s["signed"] / get_s["sealed"]
    print(f"  {nb // 1024:5d} KiB blocks, compression {compression:<4}: put + flush sealed "
          f"{total / put_s['sealed']:5.2f} GB/s, signed {total / put_s['signed']:5.2f} GB/s = {ratios[0]:4.2f}x   "
          f"get_into sealed {total / get_s['sealed']:5.2f} GB/s, signed {total / get_s['signed']:5.2f} GB/s = "
          f"{ratios[1]:4.2f}x")
    for tier in tiers.values():
        tier.close()
    raw.close()
    return ratios


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="an existing server (its database is flushed!); default: start valkey-server")
    ap.add_argument("--quick", action="store_true", help="fewer blocks and repeats (a smoke run)")
    ap.add_argument("--seal-vs-sign", type=int, metavar="ROUNDS", default=0,
                    help="only sealed against signed-only values, interleaved, best of ROUNDS")
    ap.add_argument("--blocks", type=int, default=None, help="blocks per run (default 256; 32 with --quick)")
    args = ap.parse_args(argv)
    blocks, repeat = (32, 2) if args.quick else (256, 5)
    blocks = args.blocks or blocks
    server = None
    if args.url is None:
        from valkey_server import ValkeyServer

        server = ValkeyServer(maxmemory="4gb")
    url = args.url or server.url
    try:
        if args.seal_vs_sign:
            print(f"sealed (AES-256-GCM) against signed-only (HMAC-SHA256) values on {url}, interleaved "
                  f"({blocks} blocks, best of {args.seal_vs_sign}):")
            for layers in (2, 16):
                values_alone(layers, blocks, args.seal_vs_sign)
            for layers in (2, 16):
                for compression in ("none", "auto"):
                    seal_vs_sign(url, layers, blocks, compression, args.seal_vs_sign)
            return 0
        print(f"remote tier vs raw pipelines on {url} ({blocks} blocks per run, best of {repeat})")
        speeds: dict[tuple[int, str], dict[str, tuple[float, float]]] = {}
        for layers in (2, 16):  # 256 KiB and 2 MiB blocks
            for compression in ("none", "auto"):
                for mode in MODES:  # side by side: each one's cost is the ratio's change
                    speeds.setdefault((layers, compression), {})[mode] = run(url, layers, blocks, compression,
                                                                              repeat, mode)
        print("sealed (AES-256-GCM) against signed only (HMAC-SHA256), same server, same run:")
        for (layers, compression), by in speeds.items():
            (sp, sg), (ep, eg) = by["signed"], by["sealed"]
            print(f"  {layers:2d} layers, compression {compression:<4}: put {ep:5.2f} vs {sp:5.2f} GB/s = "
                  f"{ep / sp:4.2f}x   get {eg:5.2f} vs {sg:5.2f} GB/s = {eg / sg:4.2f}x")
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
