"""What each KV-cache group costs a ``kvstrata bench`` replay's memory, beside the estimate.

Each configuration replays in a fresh process (its resident set measured from
``/proc/self/statm``): a pool of ``--rows`` rows is built, then requests of 8
fresh blocks each go through it. Three costs come out, each printed with the
figure :mod:`kvstrata.bench.budget` estimates from and their ratio (estimate /
measured: 1 or more means the estimate covers it):

* a row of the grouped pool, built and filled (``GROUPED_GPU_BYTES_PER_BLOCK``);
* each group beyond the first, per distinct block (``GROUP_BYTES_PER_BLOCK``),
  from two runs with the same rows filled and different distinct blocks.

``python benchmarks/bench_group_memory.py [--rows 200000]``
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


def measure(groups: int, rows: int, requests: int) -> dict[str, float]:
    """Bytes the replay holds once built and once ``requests`` requests of 8 blocks went through."""
    from kvstrata.bench.replay import ReplayOptions, replaying
    from kvstrata.config.schema import KVStrataConfig
    from kvstrata.trace.requests import Request

    cfg = KVStrataConfig.from_dict({"model": {"block_nbytes": 1024, "groups": ",".join(["full"] * groups)},
                                    "gpu": {"num_blocks": rows}, "cpu": {"capacity": 0}, "ssd": {"capacity": 0}})
    gc.collect()
    before = _rss()
    with replaying(cfg, 16, ReplayOptions()) as rp:
        built = _rss()
        for i in range(requests):
            rp.step(Request(float(i), list(range(8 * i, 8 * i + 8)), 8 * 16, 1, 8))
        gc.collect()
        filled = _rss()
    return {"built": built - before, "filled": filled - before}


def _run(groups: int, rows: int, requests: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--one", json.dumps([groups, rows, requests])],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    from kvstrata.bench.budget import GROUP_BYTES_PER_BLOCK, GROUPED_GPU_BYTES_PER_BLOCK

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(*json.loads(args.one))))
        return
    rows = args.rows
    print(f"{'groups':>6}  {'distinct':>8}  {'built B/row':>11}  {'filled B/row':>12}  "
          f"{'estimate B/row':>14}  {'ratio':>5}")
    for groups in (2, 10, 100):
        distinct = rows // groups  # every row filled once
        m = _run(groups, rows, distinct // 8)
        per_row = m["filled"] / rows
        print(f"{groups:>6}  {distinct:>8,}  {m['built'] / rows:>11.0f}  {per_row:>12.0f}  "
              f"{GROUPED_GPU_BYTES_PER_BLOCK:>14}  {GROUPED_GPU_BYTES_PER_BLOCK / per_row:>5.2f}")
    # the same rows filled, 10x the distinct blocks: what a group costs beyond its row
    few, many = _run(100, rows, rows // 800), _run(100, rows, rows // 80)
    extra = (many["filled"] - few["filled"]) / ((rows // 80 - rows // 800) * 8 * 99)
    print(f"each group beyond the first, per distinct block: {extra:.0f} bytes measured, "
          f"{GROUP_BYTES_PER_BLOCK} estimated (ratio {GROUP_BYTES_PER_BLOCK / extra:.2f})")


if __name__ == "__main__":
    main()
