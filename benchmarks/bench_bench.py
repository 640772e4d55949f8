"""`kvstrata bench` on the Mooncake conversation trace vs LMCache's cache simulator sweep.

Both run as subprocesses in the same session, timed wall-clock, best of
``--repeat``:

* kvstrata: ``python -m kvstrata.cli bench --trace T --quiet --json OUT`` (parse, exact LRU curve at every
  capacity, tiered replay, per-tier lifecycle statistics, report).
* kvstrata curve alone: ``python -m kvstrata.cli inspect --trace T`` (parse, exact curve, reuse gaps), the
  same job the simulator's sweep does.
* LMCache: ``lmcache tool cache-simulator sweep`` (30 log-spaced capacities, one LRU pass each, single
  tier, token-weighted), run from the ``lmcache`` wheel fetched with ``pip download --no-deps`` (its
  simulator modules are pure Python; they need sortedcontainers and matplotlib). The trace is converted
  to its lookup-log format: one event per request, ``chunk_size`` 512, ``chunk_hashes`` = the hash ids,
  ``seq_len`` = 512 x len(hash_ids), so its token hit rate equals kvstrata's block hit rate.

The script also checks that kvstrata's curve gives the simulator's hit rate at each of the 30 capacities.
If the wheel cannot be downloaded the comparison is skipped and the script says so.

    .venv/bin/python benchmarks/bench_bench.py [--trace PATH] [--lmcache-version 0.5.6] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation.jsonl"  # ../shared beside the checkout
CHUNK_BYTES = 512 * 131072          # one 512-token block of Llama-3-8B (fp16) KV
# a tiered cache that holds the concurrency: 393,216-token GPU pool (the seed's 48 GiB), 4M tokens DRAM, 32M SSD
KVSTRATA_SETS = ["gpu.num_blocks=24576", "cpu.capacity=512GiB", "ssd.capacity=4TiB"]
SWEEP = ["--min-capacity-gib", "16", "--max-capacity-gib", "16384", "--points", "30"]

_RUN_SIM = """
import sys, types
pkg = types.ModuleType("lmcache"); pkg.__path__ = [sys.argv[1] + "/lmcache"]; sys.modules["lmcache"] = pkg
from lmcache.tools.cache_simulator.plot_hit_rate import main
sys.argv = ["sweep", *sys.argv[2:]]
main()
"""


def timed(cmd: list[str], repeat: int, **kw: object) -> tuple[float, subprocess.CompletedProcess[str]]:
    best, res = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
        best = min(best, time.perf_counter() - t0)
        if res.returncode != 0:
            raise SystemExit(f"failed: {' '.join(cmd)}\n{res.stderr[-2000:]}")
    assert res is not None
    return best, res


def fetch_lmcache(version: str, dest: Path) -> Path | None:
    res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", f"lmcache=={version}", "-d",
                          str(dest)], capture_output=True, text=True)
    wheels = sorted(dest.glob("lmcache-*.whl"))
    if res.returncode != 0 or not wheels:
        print(f"LMCache comparison skipped: pip download lmcache=={version} failed: "
              f"{(res.stderr.strip().splitlines() or ['?'])[-1]}")
        return None
    out = dest / "wheel"
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(out, [n for n in z.namelist() if n.startswith("lmcache/tools/") or n.count("/") == 1
                           and n.startswith("lmcache/")])
    return out


def to_lookup_log(trace: Path, out: Path) -> None:
    with open(trace) as src, open(out, "w") as dst:
        for i, line in enumerate(src):
            if not line.strip():
                continue
            r = json.loads(line)
            ids = r["hash_ids"]
            dst.write(json.dumps({"timestamp": r["timestamp"] / 1000.0, "request_id": str(i), "model_name": "m",
                                  "chunk_size": 512, "seq_len": 512 * len(ids),
                                  "chunk_hashes": [f"0x{h:x}" for h in ids]}) + "\n")


def parse_sweep(stdout: str) -> list[tuple[float, float]]:
    rows = []
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].endswith("%"):
            try:
                rows.append((float(parts[0]), float(parts[1][:-1]) / 100))
            except ValueError:
                pass
    return rows


def check_agreement(rows: list[tuple[float, float]], trace: Path) -> float:
    """Largest |kvstrata - LMCache| hit rate over the sweep's capacities."""
    sys.path.insert(0, str(ROOT))
    from kvstrata.bench.mrc import build_mrc
    from kvstrata.trace.reader import load_trace

    mrc = build_mrc(load_trace(trace)).mrc
    worst = 0.0
    for gib, rate in rows:
        blocks = max(1, round(gib * 1024**3) // CHUNK_BYTES)
        worst = max(worst, abs(mrc.hit_rate(blocks) - rate))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--lmcache-version", default="0.5.6")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    if not args.trace.exists():
        raise SystemExit(f"{args.trace}: trace not found")
    with tempfile.TemporaryDirectory() as tmp:
        tmpd = Path(tmp)
        env_py = [sys.executable]
        t_kvstrata, _ = timed([*env_py, "-m", "kvstrata.cli", "bench", "--trace", str(args.trace), "--quiet",
                             "--json", str(tmpd / "r.json"), *sum((["--set", s] for s in KVSTRATA_SETS), [])],
                            args.repeat, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
        report = json.loads((tmpd / "r.json").read_text())
        print(f"kvstrata bench: {t_kvstrata:.2f} s wall (inside: {report['timings_s']}); exact curve with "
              f"{len(report['mrc'])} points listed, hit rate {report['hit_rate']}")
        t_curve, _ = timed([*env_py, "-m", "kvstrata.cli", "inspect", "--trace", str(args.trace), "--json",
                            str(tmpd / "i.json")], args.repeat, cwd=ROOT,
                           env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
        print(f"kvstrata inspect (parse + exact curve + reuse gaps, no replay): {t_curve:.2f} s wall")
        wheel = fetch_lmcache(args.lmcache_version, tmpd)
        if wheel is None:
            return
        log = tmpd / "lookup_hashes_mooncake.jsonl"
        to_lookup_log(args.trace, log)
        t_sim, res = timed([*env_py, "-c", _RUN_SIM, str(wheel), "-i", str(log), "--kv-bytes-per-chunk",
                            str(CHUNK_BYTES), *SWEEP, "-o", str(tmpd / "sweep.png")], args.repeat, cwd=tmpd)
        rows = parse_sweep(res.stdout)
        print(f"LMCache {args.lmcache_version} cache-simulator sweep ({len(rows)} capacities): {t_sim:.2f} s wall")
        print(f"ratio LMCache sweep / kvstrata bench (full analysis with tiered replay): {t_sim / t_kvstrata:.2f}x")
        print(f"ratio LMCache sweep / kvstrata curve alone (inspect): {t_sim / t_curve:.2f}x")
        if rows:
            print(f"largest hit-rate difference at the sweep's capacities: {check_agreement(rows, args.trace):.2e}")


if __name__ == "__main__":
    main()
