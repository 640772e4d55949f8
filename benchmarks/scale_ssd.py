"""The SSD tier at scale: reopen time against the number of records, write speed against
the block size.

    .venv/bin/python benchmarks/scale_ssd.py [--quick] [--dir DIR] [--only reopen|write]
        [--records 10000,100000,1000000] [--sizes 4096,16384,65536,262144,2097152]

* :func:`reopen_times`: a tier of N records (``compression="none"``) is built once, in
  large batches, then reopened three ways: after a clean close (warm page cache, then
  with the tier's files dropped from it), and after a process holding it open was
  killed with SIGKILL (an unclean shutdown: recovery in the background). For each:
  seconds until the constructor returns and until a ``get`` of a stored block first
  succeeds, plus, after the SIGKILL, until the tier is fully usable
  (``wait_ready``). Also the seconds :func:`~kvstrata.tiers.ssd.tier.read_keys` takes to
  list every key from beside the owner, as the vLLM scheduler does at start-up.
* :func:`write_speeds`: sustained writes (``flush()`` every 16 MiB) of random blocks of
  each size, against a raw file write + ``fsync`` every 16 MiB of the same blocks, in
  alternating pairs (the side that goes first alternates; each run first deletes the
  previous run's files of its own kind, so both sides recycle page cache, and a first
  pair that is not counted warms both up: see ``bench_tiers.py`` on fresh memory on
  this VM); the ratio is the median of the per-pair ratios.

Both print markdown tables under ``__main__``; ``bench_scale.py`` imports the functions.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

from bench_tiers import FLUSH_EVERY, put_all, write_raw  # noqa: E402
from benchutil import drop_page_cache  # noqa: E402

MiB = 1024**2
FINGERPRINT = "scale-ssd"

__all__ = ["reopen_times", "write_speeds", "build_tier", "markdown"]


# ====================================================================== reopening

def _key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def _open(path: Path, records: int, block_nbytes: int, **kw: Any) -> Any:
    from kvstrata.tiers.ssd import SSDTier, record_footprint
    capacity = (records + 1024) * record_footprint(48, block_nbytes) + 64 * MiB
    return SSDTier(path, capacity_bytes=capacity, fingerprint=FINGERPRINT, compression="none",
                   queue_capacity_bytes=1024 * MiB, **kw)


def build_tier(path: Path, records: int, block_nbytes: int = 4096) -> float:
    """Fill a new tier at ``path`` with ``records`` blocks (keys ``i.to_bytes(32, 'big')``,
    one random block shared by all) and close it; return the seconds it took."""
    block = np.random.default_rng(records).integers(0, 256, block_nbytes, np.uint8).tobytes()
    t0 = time.perf_counter()
    tier = _open(path, records, block_nbytes)
    for i in range(records):
        while not tier.put(_key(i), block):  # the queue is full: let the writer catch up
            tier.flush()
    assert tier.flush(), tier.stats()
    tier.close()
    return time.perf_counter() - t0


def _timed_open(path: Path, records: int, block_nbytes: int) -> dict[str, float]:
    """Seconds to construct the tier, to the first successful get, and until it is fully
    usable; then it is closed (cleanly)."""
    probe = _key(records // 2)
    t0 = time.perf_counter()
    tier = _open(path, records, block_nbytes, recover_inline_bytes=0)
    opened = time.perf_counter() - t0
    while tier.get(probe) is None:
        assert tier.stats()["recovering"] or tier.stats()["available"], tier.stats()
        time.sleep(0.001)
    first = time.perf_counter() - t0
    assert tier.wait_ready(600), tier.stats()
    ready = time.perf_counter() - t0
    assert len(list(tier.keys())) >= records, "records went missing"
    tier.close()
    return {"open_s": opened, "first_get_s": first, "ready_s": ready}


_HOLD = """
import sys, numpy as np
sys.path.insert(0, sys.argv[4])
from scale_ssd import _open, _key
tier = _open(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
block = bytes(int(sys.argv[3]))
for i in range(int(sys.argv[2]), int(sys.argv[2]) + 64):
    tier.put(_key(i), block)
assert tier.flush()
print("held", flush=True)
sys.stdin.read()
"""


def _kill_holding(path: Path, records: int, block_nbytes: int) -> None:
    """Open the tier in another process, write 64 more blocks, flush, then SIGKILL it."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(path), str(records),
                             str(block_nbytes), str(HERE)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def _read_keys_s(path: Path, records: int) -> float:
    from kvstrata.tiers.ssd.tier import read_keys
    t0 = time.perf_counter()
    keys = read_keys(path, FINGERPRINT)
    seconds = time.perf_counter() - t0
    assert len(keys) >= records, len(keys)
    return seconds


def reopen_times(records: tuple[int, ...] = (10_000, 100_000, 1_000_000),
                 block_nbytes: int = 4096, root: Path | None = None) -> list[dict[str, Any]]:
    """One row per tier size: build seconds, index and page file MiB, clean reopen (warm,
    then cold), unclean reopen (after a SIGKILL) and ``read_keys`` seconds."""
    rows = []
    for n in records:
        where = Path(tempfile.mkdtemp(prefix="kvstrata-scale-", dir=root))
        try:
            rows.append(_reopen_row(where / "ssd", n, block_nbytes))
        finally:
            shutil.rmtree(where, ignore_errors=True)
    return rows


def _reopen_row(path: Path, n: int, block_nbytes: int) -> dict[str, Any]:
    row: dict[str, Any] = {"records": n, "block_nbytes": block_nbytes,
                           "build_s": build_tier(path, n, block_nbytes)}
    row["index_mib"] = (path / "data.mdb").stat().st_size / MiB
    row["blocks_mib"] = (path / "blocks.dat").stat().st_size / MiB
    clean = _timed_open(path, n, block_nbytes)
    drop_page_cache(path)
    cold = _timed_open(path, n, block_nbytes)
    row.update({"clean_open_s": clean["open_s"], "clean_first_get_s": clean["first_get_s"],
                "cold_open_s": cold["open_s"], "cold_first_get_s": cold["first_get_s"]})
    _kill_holding(path, n, block_nbytes)
    unclean = _timed_open(path, n, block_nbytes)
    row.update({"unclean_open_s": unclean["open_s"],
                "unclean_first_get_s": unclean["first_get_s"],
                "unclean_ready_s": unclean["ready_s"],
                "read_keys_s": _read_keys_s(path, n)})
    return row


# ====================================================================== writing

def _write_tier(path: Path, blocks: np.ndarray, keys: list[bytes]) -> float:
    from kvstrata.tiers.ssd import SSDTier
    tier = SSDTier(path, capacity_bytes=2 * blocks.nbytes + 64 * MiB, fingerprint=FINGERPRINT,
                   compression="none", queue_capacity_bytes=4 * FLUSH_EVERY)
    seconds = put_all(tier, keys, blocks)
    stats = tier.stats()
    tier.close()
    assert stats["dropped_queue_full"] == 0 and stats["blocks_written"] == len(keys), stats
    return seconds


def write_speeds(sizes: tuple[int, ...] = (4096, 16384, 65536, 262144, 2097152),
                 total_bytes: int = 256 * MiB, pairs: int = 6,
                 root: Path | None = None) -> list[dict[str, Any]]:
    """One row per block size: raw and tier GB/s (medians) and the median per-pair ratio."""
    rows = []
    where = Path(tempfile.mkdtemp(prefix="kvstrata-scale-", dir=root))
    try:
        for size in sizes:
            rows.append(_write_row(where, size, total_bytes, pairs))
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return rows


def _write_row(where: Path, size: int, total_bytes: int, pairs: int) -> dict[str, Any]:
    n = max(total_bytes // size, 1)
    blocks = np.random.default_rng(size).integers(0, 256, (n, size), dtype=np.uint8)
    keys = [_key(i) for i in range(n)]
    os.sync()  # no writeback left over from before competes with these runs
    raw_s: list[float] = []
    tier_s: list[float] = []
    last: dict[str, Path] = {}
    for rep in range(pairs + 1):  # the first pair only warms up: fresh memory is slow here
        for side in (("raw", "tier") if rep % 2 == 0 else ("tier", "raw")):
            old = last.get(side)
            if old is not None:
                shutil.rmtree(old) if old.is_dir() else old.unlink()
            last[side] = where / f"{side}-{size}-{rep}"
            if side == "raw":
                raw_s.append(write_raw(last[side], blocks))
            else:
                tier_s.append(_write_tier(last[side], blocks, keys))
    for old in last.values():
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    raw_s, tier_s = raw_s[1:], tier_s[1:]
    ratios = sorted(r / t for r, t in zip(raw_s, tier_s))
    raw_gbps = blocks.nbytes / statistics.median(raw_s) / 1e9
    ratio = statistics.median(ratios)
    return {"block_nbytes": size, "blocks": n, "raw_gbps": raw_gbps, "tier_gbps": raw_gbps * ratio,
            "ratio": ratio, "pair_ratios": ratios}


# ====================================================================== output

def markdown(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """A markdown table of ``rows``: ``columns`` are (key, heading, format)."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |",
             "|" + "|".join("---:" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(format(row[k], f) for k, _, f in columns) + " |")
    return "\n".join(lines)


REOPEN_COLUMNS = [("records", "records", ","), ("index_mib", "data.mdb MiB", ".0f"),
                  ("build_s", "build s", ".1f"), ("clean_open_s", "clean open s", ".3f"),
                  ("clean_first_get_s", "clean first get s", ".3f"),
                  ("cold_open_s", "cold clean open s", ".3f"),
                  ("cold_first_get_s", "cold first get s", ".3f"),
                  ("unclean_open_s", "unclean open s", ".3f"),
                  ("unclean_first_get_s", "unclean first get s", ".2f"),
                  ("unclean_ready_s", "unclean ready s", ".2f"),
                  ("read_keys_s", "read_keys s", ".2f")]
WRITE_COLUMNS = [("block_nbytes", "block bytes", ","), ("raw_gbps", "raw write+fsync GB/s", ".2f"),
                 ("tier_gbps", "tier GB/s", ".2f"), ("ratio", "ratio", ".2f")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller tiers and data")
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: temp)")
    ap.add_argument("--only", choices=("reopen", "write"), default=None)
    ap.add_argument("--records", default=None, help="comma-separated record counts")
    ap.add_argument("--sizes", default=None, help="comma-separated block sizes")
    args = ap.parse_args(argv)
    records = tuple(int(x) for x in args.records.split(",")) if args.records else \
        ((10_000, 100_000) if args.quick else (10_000, 100_000, 1_000_000))
    sizes = tuple(int(x) for x in args.sizes.split(",")) if args.sizes else \
        (4096, 16384, 65536, 262144, 2097152)
    if args.only != "write":
        print("Reopening a tier of 4 KiB blocks (compression none):\n")
        print(markdown(reopen_times(records, root=args.dir), REOPEN_COLUMNS), flush=True)
    if args.only != "reopen":
        print(f"\nSustained writes, flush every {FLUSH_EVERY // MiB} MiB, compression none:\n")
        rows = write_speeds(sizes, total_bytes=(64 if args.quick else 256) * MiB,
                            pairs=2 if args.quick else 6, root=args.dir)
        print(markdown(rows, WRITE_COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
