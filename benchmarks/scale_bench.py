"""`kvstrata bench` time and peak memory at 1x / 10x / 100x trace sizes, side by side in one run.

The Nx trace is the Mooncake conversation trace written N times in a row,
each copy's timestamps shifted past the previous copy's end. By default
every copy keeps the same hash ids, so the same conversations come back
every hour and the trace's distinct blocks stay those of one copy: memory
should not move while accesses grow N times. With ``--fresh-ids`` each copy
gets ids of its own (distinct blocks grow N times too), the worst case for
memory: an analysis whose memory follows distinct blocks grows with N there.

Each size runs ``python -m kvstrata.cli bench --trace T --quiet --json OUT`` in
a subprocess of its own (the default deployment; ``--set`` adds overrides),
timed wall-clock. Peak memory is read two ways: the largest resident set of
any one process (the bench process or its miss-ratio child, from the rusage
``os.wait4`` returns for that subprocess, the same numbers
``getrusage(RUSAGE_CHILDREN)`` accumulates), and the peak of the sum of the
process tree's proportional set sizes (``Pss`` in ``/proc/PID/smaps_rollup``,
sampled every 0.2 s; pages the fork shares are counted once). Ratios are to
the first size of the run.

    .venv/bin/python benchmarks/scale_bench.py [--scales 1,10,100] [--fresh-ids] [--trace PATH]
        [--workdir DIR] [--set KEY=VALUE ...]

``bench_sizes`` is imported by ``benchmarks/bench_scale.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation.jsonl"  # ../shared beside the checkout
_SAMPLE_S = 0.2

__all__ = ["TRACE", "bench_sizes", "make_trace", "measure", "table"]


# ------------------------------------------------------------------ traces

def _records(src: Path) -> list[dict[str, Any]]:
    with open(src, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def make_trace(src: Path, dst: Path, repeat: int, fresh_ids: bool = False) -> dict[str, int]:
    """Write ``src`` (a Mooncake-format trace) ``repeat`` times into ``dst``; returns its counts.

    Copy ``k`` is shifted by ``k`` times the source's span (its duration plus its mean gap between
    arrivals); with ``fresh_ids`` its hash ids are offset by ``k`` times (largest id + 1)."""
    recs = _records(src)
    if not recs:
        raise ValueError(f"{src}: no records")
    first, last = recs[0]["timestamp"], recs[-1]["timestamp"]
    span = (last - first) + max(1, (last - first) // max(1, len(recs) - 1))
    id_span = 1 + max((max(r["hash_ids"]) for r in recs if r["hash_ids"]), default=0)
    lines = [(r["timestamp"], {k: v for k, v in r.items() if k not in ("timestamp", "hash_ids")}, r["hash_ids"])
             for r in recs]
    accesses = sum(len(ids) for _, _, ids in lines)
    with open(dst, "w", encoding="utf-8") as out:
        for k in range(repeat):
            out.writelines(_copy(lines, k * span, k * id_span if fresh_ids else 0))
    distinct = len({h for _, _, ids in lines for h in ids}) * (repeat if fresh_ids else 1)
    return {"requests": len(lines) * repeat, "accesses": accesses * repeat, "distinct": distinct}


def _copy(lines: list[tuple[Any, dict[str, Any], list[int]]], shift: int, id_shift: int) -> Iterator[str]:
    for ts, rest, ids in lines:
        body = json.dumps(rest)[1:-1]
        text = ", ".join(str(h + id_shift) for h in ids)
        yield f'{{"timestamp": {ts + shift}, {body}, "hash_ids": [{text}]}}\n'


# ------------------------------------------------------------------ measuring

def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


class _TreeSampler(threading.Thread):
    """Peak of the summed Pss of a process and its children, sampled until :meth:`stop`."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak_kib = pid, 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(_SAMPLE_S):
            pids = [self.pid, *_children(self.pid)]
            self.peak_kib = max(self.peak_kib, sum(map(_pss_kib, pids)))

    def stop(self) -> int:
        self._done.set()
        self.join()
        return self.peak_kib


def measure(trace: Path, sets: Sequence[str] = ()) -> dict[str, Any]:
    """Run ``kvstrata bench`` on ``trace`` in a subprocess: wall seconds, peak memory, its report."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "kvstrata.cli", "bench", "--trace", str(trace), "--quiet", "--json", str(out),
               *(a for s in sets for a in ("--set", s))]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        sampler = _TreeSampler(proc.pid)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        tree_kib = sampler.stop()
        stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {stderr[-2000:]}")
        report = json.loads(out.read_text())
    return {"wall_s": wall, "peak_rss_mib": usage.ru_maxrss / 1024, "tree_pss_mib": tree_kib / 1024,
            "report": report, "command": " ".join(cmd[1:])}


def bench_sizes(scales: Sequence[int] = (1, 10, 100), *, trace: Path = TRACE, fresh_ids: bool = False,
                workdir: Path | None = None, sets: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Measure ``kvstrata bench`` on the trace repeated ``scale`` times, for each scale, in one run.

    Each row: scale, requests, accesses, distinct, wall_s, peak_rss_mib (largest process),
    tree_pss_mib (the processes together), hit_rate, timings_s, and the ratios of time,
    memory and accesses to the first row's."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for scale in scales:
            path = Path(tmp) / f"x{scale}{'-fresh' if fresh_ids else ''}.jsonl"
            counts = make_trace(trace, path, scale, fresh_ids)
            got = measure(path, sets)
            path.unlink()
            rep = got.pop("report")
            assert rep["block_accesses"] == counts["accesses"], (rep["block_accesses"], counts)
            rows.append({"scale": scale, **counts, "distinct": rep["distinct_blocks"], **got,
                         "hit_rate": rep["hit_rate"]["total"], "timings_s": rep["timings_s"],
                         "fresh_ids": fresh_ids})
    return _with_ratios(rows)


def _with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not rows:
        return rows
    base = rows[0]
    for r in rows:
        r["time_ratio"] = r["wall_s"] / base["wall_s"]
        r["rss_ratio"] = r["peak_rss_mib"] / base["peak_rss_mib"]
        r["pss_ratio"] = r["tree_pss_mib"] / base["tree_pss_mib"] if base["tree_pss_mib"] else float("nan")
        r["accesses_ratio"] = r["accesses"] / base["accesses"]
        r["us_per_access"] = 1e6 * r["wall_s"] / r["accesses"]
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (ratios to the first row)."""
    head = ("| trace | requests | block accesses | distinct blocks | wall s | time ratio | us/access | "
            "peak RSS, largest process (MiB) | ratio | peak Pss, all processes (MiB) | ratio | hit rate |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ids = "fresh ids" if r.get("fresh_ids") else "same ids"
        lines.append(f"| {r['scale']}x ({ids}) | {r['requests']:,} | {r['accesses']:,} | {r['distinct']:,} | "
                     f"{r['wall_s']:.1f} | {r['time_ratio']:.2f}x | {r['us_per_access']:.2f} | "
                     f"{r['peak_rss_mib']:,.0f} | {r['rss_ratio']:.2f}x | {r['tree_pss_mib']:,.0f} | "
                     f"{r['pss_ratio']:.2f}x | {100 * r['hit_rate']:.1f}% |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", default="1,10,100", help="comma-separated repeat counts (default: 1,10,100)")
    ap.add_argument("--fresh-ids", action="store_true", help="give each copy hash ids of its own")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--workdir", type=Path, default=None, help="where the traces are written (default: $TMPDIR)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a kvstrata bench --set")
    args = ap.parse_args(argv)
    if not args.trace.exists():
        raise SystemExit(f"{args.trace}: trace not found")
    rows = bench_sizes([int(s) for s in args.scales.split(",")], trace=args.trace, fresh_ids=args.fresh_ids,
                       workdir=args.workdir, sets=args.set)
    print(table(rows))
    print(f"\ncommand per size (the trace written N times): {rows[-1]['command']}")
    print(f"this process's children, largest resident set: "
          f"{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:,.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
