"""Subprocess side of the SSD tier tests: writes, crashes and checks in a fresh process.

    python ssd_helper.py write  PATH N SEED   put N blocks, flush, exit without close
    python ssd_helper.py stream PATH SEED     put blocks forever; print each flushed count
    python ssd_helper.py check  PATH N SEED   read N blocks; print a JSON summary; exit 1 on
                                              wrong data or any exception

Blocks are a deterministic function of (SEED, i), so any process can verify them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys

import numpy as np

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


def open_tier(path: str):
    from tierkv.ssd_tier import SSDTier
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


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    mode, path = argv[1], argv[2]
    if mode == "write":
        write(path, int(argv[3]), int(argv[4]))
    elif mode == "stream":
        stream(path, int(argv[3]))
    elif mode == "check":
        return check(path, int(argv[3]), int(argv[4]))
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
