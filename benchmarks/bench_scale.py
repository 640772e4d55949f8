"""Scale: what grows with the tiers and the traces, side by side in one run.

* SSD tier reopen at 10k / 100k / 1M records, clean and unclean
  (``benchmarks/scale_ssd.py``: ``reopen_times``);
* the scheduler's memory per SSD block and its start-up seeding, and per block
  stored in the run, its lifecycle included (``benchmarks/scale_policy.py``:
  ``policy_memory``, ``steady_memory``);
* SSD write GB/s by block size against raw write + fsync of the same sizes
  (``scale_ssd.write_speeds``);
* ``kvstrata bench`` time and peak memory at 1x / 10x / 100x trace sizes
  (``benchmarks/scale_bench.py``: ``bench_sizes``);
* kvstrata's start-up under vLLM's scheduler over a 1M-record SSD tier against an
  empty one, to the first request served (``benchmarks/scale_startup.py``: ``run``).

    .venv/bin/python benchmarks/bench_scale.py [--quick] [--only reopen,policy,write,bench,startup]

``--quick`` runs the small sizes only (10k / 100k records, 1x / 10x traces).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PARTS = ("reopen", "policy", "write", "bench", "startup")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes only")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {', '.join(PARTS)}")
    args = ap.parse_args(argv)
    parts = [p for p in args.only.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"--only: unknown parts {unknown}; choose from {', '.join(PARTS)}")
    for part in parts:
        t0 = time.perf_counter()
        print(f"## {part}\n")
        print(_run(part, args.quick))
        print(f"\n({time.perf_counter() - t0:.0f} s)\n", flush=True)
    return 0


def _run(part: str, quick: bool) -> str:
    if part == "policy":
        import scale_policy

        seeded = scale_policy.table(scale_policy.policy_memory((100_000,) if quick else (100_000, 1_000_000)))
        steady = scale_policy.steady_table(scale_policy.steady_memory((300_000,) if quick else (2_000_000,)))
        return f"{seeded}\n\nAfter storing them (policy and lifecycle):\n\n{steady}"
    if part in ("reopen", "write"):
        import scale_ssd

        if part == "reopen":
            rows = scale_ssd.reopen_times((10_000, 100_000) if quick else (10_000, 100_000, 1_000_000))
            return scale_ssd.markdown(rows, scale_ssd.REOPEN_COLUMNS)
        rows = scale_ssd.write_speeds((4096, 16384, 65536) if quick else (4096, 16384, 65536, 262144, 2097152))
        return scale_ssd.markdown(rows, scale_ssd.WRITE_COLUMNS)
    if part == "startup":
        import shutil
        import tempfile

        import scale_startup

        where = Path(tempfile.mkdtemp(prefix="kvstrata-startup-"))
        try:
            return scale_startup.markdown(scale_startup.run(100_000 if quick else 1_000_000, 2, 3, where))
        finally:
            shutil.rmtree(where, ignore_errors=True)
    import scale_bench

    return scale_bench.table(scale_bench.bench_sizes((1, 10) if quick else (1, 10, 100)))


if __name__ == "__main__":
    sys.exit(main())
