"""Subprocess side of the SSD tier tests: writes, crashes and checks in a fresh process.

    python ssd_helper.py write  PATH N SEED   put N blocks, flush, exit without close
    python ssd_helper.py stream PATH SEED     put blocks forever; print each flushed count
    python ssd_helper.py check  PATH N SEED   read N blocks; print a JSON summary; exit 1 on
                                              wrong data or any exception
    python ssd_helper.py hold   PATH MAPSIZE  hold the LMDB writer lock of PATH (a tier's
                                              writer thread stalls) until stdin closes
    python ssd_helper.py efbig  PATH LIMIT    put blocks into a tier whose files may not grow
                                              past LIMIT bytes; print a JSON summary

Blocks are a deterministic function of (SEED, i), so any process can verify them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys

import numpy as np

from kvstrata.tiers.ssd import SSDTier

CAPACITY = 64 * 1024**2
FINGERPRINT = "test-model/fp16/bs16"


def key_of(seed: int, i: int) -> bytes:
    return hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=32).digest()


def block_of(seed: int, i: int) -> bytes:
    """Alternately random bytes and fp16 normals (compressible high plane), varied sizes."""
    rng = np.random.default_rng([seed, i])
    n = (16 * 1024, 64 * 1024, 100_000)[i % 3]
    if i % 2:
        return rng.standard_normal(n // 2).astype(np.float16).tobytes()
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def open_tier(path: str) -> SSDTier:
    return SSDTier(path, capacity_bytes=CAPACITY, fingerprint=FINGERPRINT)


def write(path: str, n: int, seed: int) -> None:
    tier = open_tier(path)
    for i in range(n):
        assert tier.put(key_of(seed, i), block_of(seed, i))
    assert tier.flush()
    print("flushed", n, flush=True)
    os._exit(0)  # no close(): flushed blocks must survive a plain exit


def stream(path: str, seed: int) -> None:
    tier = open_tier(path)
    i = 0
    while True:
        tier.put(key_of(seed, i), block_of(seed, i))
        i += 1
        if i % 8 == 0:
            tier.flush()
            print(i, flush=True)


def check(path: str, n: int, seed: int) -> int:
    tier = open_tier(path)
    keys = [key_of(seed, i) for i in range(n)]
    got = tier.get_many(keys[: n // 2]) + [tier.get(key) for key in keys[n // 2:]]
    wrong = [i for i, g in enumerate(got) if g is not None and g != block_of(seed, i)]
    hits = [i for i, g in enumerate(got) if g is not None]
    tier.put(key_of(seed, n + 1), block_of(seed, n + 1))  # writing after damage must not raise
    tier.flush()
    print(json.dumps({"hits": hits, "wrong": wrong, "stats": tier.stats()}), flush=True)
    tier.close()
    return 1 if wrong else 0


def hold(path: str, map_size: int) -> None:
    import lmdb
    env = lmdb.open(path, map_size=map_size, max_dbs=8)
    txn = env.begin(write=True)
    print("held", flush=True)
    sys.stdin.read()
    txn.abort()
    env.close()


def efbig(path: str, limit: int) -> None:
    """Page writes past ``limit`` bytes fail with EFBIG, a real write error like a full disk.
    Prints which keys were reported lost and which are present at each step."""
    import resource
    import signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    tier = SSDTier(path, capacity_bytes=CAPACITY, fingerprint=FINGERPRINT, compression="none")
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    keys = [key_of(0, i) for i in range(limit // 65536 + 6)]
    full = limit // 65536                  # 64 KiB blocks that fit below the limit
    out: dict = {}
    out["flush_ok"] = []
    for i, key in enumerate(keys[:full + 4]):
        assert tier.put(key, block_of(9, i * 3 + 1)), i  # 65,536-byte blocks of kind 1
        out["flush_ok"].append(tier.flush())
    out["lost_full"] = [keys.index(k) for k in tier.take_lost()]
    assert tier.put(keys[full + 4], block_of(9, (full + 4) * 3 + 1))
    tier.discard_many(keys[:2])            # mostly joins the failing batch, then is retried
    out["flushed"] = tier.flush()
    out["lost_discard"] = [keys.index(k) for k in tier.take_lost()]
    assert tier.put(keys[full + 5], block_of(9, (full + 5) * 3 + 1))  # in freed pages
    out["recovered"] = tier.flush()
    out["present"] = [i for i, key in enumerate(keys) if key in tier]
    out["exact"] = all(tier.get(key) == block_of(9, i * 3 + 1)
                       for i, key in enumerate(keys) if i in out["present"])
    out["stats"] = tier.stats()
    print(json.dumps(out), flush=True)
    tier.close()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    mode, path = argv[1], argv[2]
    if mode == "write":
        write(path, int(argv[3]), int(argv[4]))
    elif mode == "stream":
        stream(path, int(argv[3]))
    elif mode == "check":
        return check(path, int(argv[3]), int(argv[4]))
    elif mode == "hold":
        hold(path, int(argv[3]))
        return 0
    elif mode == "efbig":
        efbig(path, int(argv[3]))
        return 0
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
