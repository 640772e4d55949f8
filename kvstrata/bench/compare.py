"""``kvstrata bench --compare``: every eviction order and SSD admission, at several capacities, on one trace.

Each row is a full replay through the tier policy (the one the plugin and the
library run) with ``cpu.eviction`` and ``ssd.eviction`` set to the row's order and
``ssd.admission`` to its admission, at one pair of lower-tier capacities. All rows
are replayed in one pass over the trace per process (the rows split across the
spare cores, each a forked process). A row's ``set`` are the ``--set`` values
that give a plain ``kvstrata bench`` the same run: its hit rate is reproduced
exactly.

A ``cost`` row's weight ``alpha`` is chosen per capacity point as Marconi
chooses it: of :data:`ALPHAS`, the one whose replay of the trace's first quarter
(recent traffic, as a deployment would have it) saves the most prefill FLOPs.

Capacity points ``(slab_blocks, store_blocks)``, unless given: the persistent store
(the SSD tier) at 10%, 25% and 50% of the trace's working set (its distinct blocks),
where capacity decides what is kept, with the DRAM slab (the CPU tier) a quarter of
that (write-through keeps the store a superset of it).

``policy_ns_per_op`` is each order's own cost: a SlotIndex of 65,536 slots serving
a skewed synthetic stream of 200,000 lookups (touch on a hit, a placement on a
miss), in this process; the replay's wall time is shown beside it as context.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from kvstrata.bench.budget import cores
from kvstrata.bench.capacity import config_for_trace
from kvstrata.bench.diagnose import label
from kvstrata.bench.replay import ReplayOptions, ReplayResult, replaying, requests_of
from kvstrata.bench.replay_result import persistent
from kvstrata.policy.order_overhead import policy_ns_per_op
from kvstrata.policy.tiers import GPU, LOWER
from kvstrata.system.values import ALWAYS, COST, EVICTIONS, TIER_ADMISSIONS, eviction_alpha, eviction_name, format_size

if TYPE_CHECKING:
    from kvstrata.config.schema import KVStrataConfig
    from kvstrata.trace.reader import TraceReader
    from kvstrata.trace.requests import Request, Trace

__all__ = ["FRACTIONS", "OPTIMAL", "capacity_points", "compare", "render_compare"]

OPTIMAL = "optimal"  # Belady's offline optimum (kvstrata.bench.optimal): the bound, not a policy

FRACTIONS = (0.10, 0.25, 0.50)  # of the working set: the store's capacity at each point
ALPHAS = (0.25, 0.5, 1.0, 2.0, 4.0)  # the ``cost`` order's weights tried at each point
TUNE_SHARE = 4                       # ... on the trace's first quarter
_SLAB_SHARE = 4                  # the slab holds a quarter of the store's blocks


def capacity_points(distinct_blocks: int, fractions: Sequence[float] = FRACTIONS) -> list[tuple[int, int]]:
    """``(slab_blocks, store_blocks)`` at ``fractions`` of a working set of ``distinct_blocks``."""
    out = []
    for f in fractions:
        store = max(4, int(f * distinct_blocks))
        out.append((max(1, store // _SLAB_SHARE), store))
    return list(dict.fromkeys(out))


def _row_config(config: "KVStrataConfig", block_size: int, slab: int, store: int, eviction: str,
                admission: str) -> tuple["KVStrataConfig", list[str]]:
    """The config of one row (``slab`` blocks of DRAM, ``store`` of SSD) and the ``--set``
    values that give it (capacities in bytes: the same blocks of the trace's size whatever the
    config's block size)."""
    from kvstrata.tiers.ssd.record import NS_LEN, record_footprint

    nbytes = config_for_trace(config, block_size).block_nbytes()
    sets = [f"cpu.capacity={slab * nbytes}", f"ssd.capacity={store * record_footprint(NS_LEN + 32, nbytes)}",
            f"cpu.eviction={eviction}", f"ssd.eviction={eviction}", f"ssd.admission={admission}"]
    from kvstrata.config.schema import KVStrataConfig

    return KVStrataConfig.from_dict(config.to_dict(), sets), sets


def compare(trace: "Trace | TraceReader", config: "KVStrataConfig", options: ReplayOptions = ReplayOptions(),
            points: Sequence[tuple[int, int]] | None = None,
            progress: Callable[[int], None] | None = None, workers: int | None = None) -> dict[str, Any]:
    """Replay ``trace`` under every eviction x admission at each capacity point: in one pass per
    process, the rows split across ``workers`` forked processes (default: one per spare core,
    at most 4; progress is reported only with one)."""
    _check_tiers(config)
    requests = list(requests_of(trace))
    info = trace.info
    distinct = info.num_distinct_blocks
    points = list(points) if points else capacity_points(distinct)
    n_rows = len(points) * len(EVICTIONS) * len(TIER_ADMISSIONS)
    _check_memory(config, trace.block_size, n_rows, distinct, options.max_memory,
                  info.num_accesses * _BYTES_PER_ACCESS * n_workers(workers, n_rows))
    alphas = {point: tune_alpha(requests[:len(requests) // TUNE_SHARE], trace.block_size, config, options, point)
              for point in points}
    rows = [(*point, f"{COST}:{alphas[point]:g}" if ev == COST else ev, adm)
            for point in points for ev in EVICTIONS for adm in TIER_ADMISSIONS]
    duration = (requests[-1].timestamp - requests[0].timestamp) if requests else 0.0
    costs = {ev: policy_ns_per_op(ev) for ev in EVICTIONS}
    n = n_workers(workers, len(rows))
    t0 = time.perf_counter()
    indexed = list(enumerate(rows))
    job = (requests, trace.block_size, config, options, [indexed[i::n] for i in range(n)], duration, costs)
    if n == 1:
        out_rows = _replay_rows(job, 0, progress)
    else:
        out_rows = _forked(job, n)
    wall = time.perf_counter() - t0
    out_rows.sort(key=lambda r: r.pop("_row"))
    rejected = out_rows[0].pop("_rejected") if out_rows else 0
    for r in out_rows:
        r.pop("_rejected", None)
    out_rows = _with_optimal(out_rows, requests, trace.block_size)
    return {"trace": info.name, "distinct_blocks": distinct, "requests": len(requests),
            "duration_s": round(duration, 3), "gpu_blocks": out_rows[0]["gpu_blocks"] if out_rows else 0,
            "rejected_requests": rejected, "skipped_lines": info.skipped_lines, "first_skipped": info.first_skipped,
            "wall_s": round(wall, 3), "workers": n, "rows": out_rows}


def _check_tiers(config: "KVStrataConfig") -> None:
    """--compare weighs the SSD tier's admission and the local tiers' orders: it needs an SSD
    tier, and a modelled shared tier would serve hits the bound does not count."""
    from kvstrata.bench.remote import models_shared
    from kvstrata.errors import ConfigError

    if not config.ssd.enabled:
        raise ConfigError("--compare: the SSD tier is off (ssd.path or ssd.capacity); it compares SSD admissions "
                          "and tier orders, so it needs one")
    if models_shared(config):
        raise ConfigError("--compare: compares this replica's own tiers; remote.url and remote.capacity model a "
                          "shared tier (drop them, or size a fleet with --replicas)")


#: a row's replay per distinct block of the trace: 151 bytes measured (18 rows of the Mooncake
#: conversation trace, 182,790 distinct blocks: 500 MB above the interpreter), with headroom
ROW_BYTES_PER_DISTINCT_BLOCK = 250
_BYTES_PER_ACCESS = 16  # each worker's view of the request list (block ids as written by the trace)


def _check_memory(config: "KVStrataConfig", block_size: int, rows: int, distinct: int, limit: int | None,
                  shared: int = 0) -> None:
    """Refuse a comparison whose replays together would not fit ``limit`` (None: half the machine's)."""
    from kvstrata.bench.budget import GROUP_BYTES_PER_BLOCK, deployment_bytes
    from kvstrata.bench.capacity import tier_capacities
    from kvstrata.errors import ConfigError
    from kvstrata.system.machine import default_max_memory

    limit = limit if limit is not None else default_max_memory()
    groups = config.model.num_groups  # each group of a block is a block of its own in every row's replay
    per_row = distinct * (ROW_BYTES_PER_DISTINCT_BLOCK + (groups - 1) * GROUP_BYTES_PER_BLOCK) + sum(
        deployment_bytes(tier_capacities(config_for_trace(config, block_size)), groups=groups).values())
    need = rows * per_row + shared
    if limit is not None and need > limit:
        of = f", {groups} KV-cache groups" if groups > 1 else ""
        raise ConfigError(f"--compare: replaying its {rows} rows of this trace ({distinct:,} distinct blocks{of}) "
                          f"needs ~{format_size(need)} of memory, more than --max-memory {format_size(limit)}; "
                          f"raise --max-memory or compare a part of the trace")


_JOB: Any = None  # the job a forked worker reads (set before the fork: nothing is pickled but its rows back)


def _forked(job: Any, n: int) -> list[dict[str, Any]]:
    """Chunks 1..n-1 in forked processes, chunk 0 here. A worker that dies (killed, out of
    memory) is an error, not a wait; Ctrl-C is the parent's to report."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    from kvstrata.bench.replay import ReplayError

    global _JOB
    _JOB = job
    pool = ProcessPoolExecutor(n - 1, mp_context=multiprocessing.get_context("fork"), initializer=_quiet_worker)
    try:
        others = [pool.submit(_replay_chunk, i) for i in range(1, n)]
        mine = _replay_rows(job, 0, None)
        return mine + [r for f in others for r in f.result()]
    except BrokenProcessPool:
        raise ReplayError("--compare: a worker process died (killed, or out of memory?); "
                          "compare a part of the trace, or free memory and rerun") from None
    except BaseException:  # Ctrl-C or an error here: the workers stop now, not when their rows are done
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.terminate()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        _JOB = None


def _quiet_worker() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _replay_chunk(i: int) -> list[dict[str, Any]]:
    return _replay_rows(_JOB, i, None)


def _replay_rows(job: Any, chunk: int, progress: Callable[[int], None] | None) -> list[dict[str, Any]]:
    """The rows of ``job``'s chunk, replayed together in one pass over its requests."""
    requests, block_size, config, options, chunks, duration, costs = job
    indexed = chunks[chunk]
    rows = [row for _, row in indexed]
    with contextlib.ExitStack() as opened:
        made = [_row_config(config, block_size, *row) for row in rows]
        replayers = [opened.enter_context(replaying(cfg, block_size, options)) for cfg, _ in made]
        for n, r in enumerate(requests, 1):
            for rp in replayers:
                rp.step(r)
            if progress is not None and n & 255 == 0:
                progress(n)
    out = []
    for (i, (_, store, ev, adm)), (_, sets), rp in zip(indexed, made, replayers):
        assert rp.result is not None
        row = _row(rp.result, store, ev, adm, sets, duration, block_size, costs[eviction_name(ev)])
        out.append({**row, "_row": i, "_rejected": rp.result.rejected})
    return out


def n_workers(workers: int | None, rows: int) -> int:
    """Processes a comparison of ``rows`` runs in: ``workers``, or one per core, at most 4."""
    return max(1, min(workers if workers is not None else cores(), 4, rows))


def _row(res: ReplayResult, store: int, eviction: str, admission: str, sets: list[str], duration: float,
         block_size: int, ns_per_op: float) -> dict[str, Any]:
    """One row's outcome; its drive writes per day are of the ``store`` blocks its point gives the SSD tier."""
    rates = res.hit_rate()
    written = res.persistent_bytes_written()
    drive_bytes = store * res.config.block_nbytes()
    per_hour = written * 3600 / duration if duration > 0 else None
    dwpd = written * 86400 / duration / drive_bytes if duration > 0 and drive_bytes else None
    return {"eviction": eviction_name(eviction), "alpha": eviction_alpha(eviction), "admission": admission,
            "cpu_blocks": res.slab_blocks(),
            "ssd_blocks": res.persistent_blocks(), "gpu_blocks": res.capacity_blocks.get(GPU, 0),
            "set": sets, "hit_rate": round(rates["total"], 6),
            "hit_rates": {t: round(v, 6) for t, v in rates.items() if t != "total"},
            "prefill_tokens_saved": res.hits * block_size, "prefill_flops_saved": res.flops_saved(),
            "ssd_bytes_written": written,
            "ssd_bytes_per_hour": round(per_hour) if per_hour is not None else None,
            "drive_writes_per_day": round(dwpd, 4) if dwpd is not None else None,
            "admissions_rejected": persistent(res.stats.get("admissions_rejected", {})),
            "policy_ns_per_op": round(ns_per_op, 1), "replay_s": round(res.wall_s, 3),
            "cache_blocks": res.spec.effective_blocks(res.capacity_blocks.get(GPU, 0))}


def tune_alpha(requests: Sequence["Request"], block_size: int, config: "KVStrataConfig", options: ReplayOptions,
               point: tuple[int, int]) -> float:
    """The ``cost`` order's weight for one capacity point, chosen as Marconi chooses it: the
    weight of :data:`ALPHAS` whose replay of recent traffic (``requests``: the trace's first
    :data:`TUNE_SHARE`-th) saves the most prefill FLOPs; ties go to the smaller weight, the
    one closer to LRU."""
    with contextlib.ExitStack() as opened:
        made = [_row_config(config, block_size, *point, f"{COST}:{a:g}", ALWAYS)[0] for a in ALPHAS]
        replayers = [opened.enter_context(replaying(cfg, block_size, options)) for cfg in made]
        for r in requests:
            for rp in replayers:
                rp.step(r)
    saved = [rp.result.compute_saved if rp.result is not None else 0.0 for rp in replayers]
    return ALPHAS[max(range(len(ALPHAS)), key=lambda i: (saved[i], -i))]


def _with_optimal(rows: list[dict[str, Any]], requests: list["Request"], block_size: int) -> list[dict[str, Any]]:
    """``rows`` with, before each capacity point's rows, Belady's optimum for a cache of as many
    blocks as that point's hierarchy holds (``cache_blocks``: the policy's own rule,
    ``effective_blocks``)."""
    from kvstrata.bench.optimal import belady_hits

    accesses = [b for r in requests for b in r.blocks]
    first: dict[tuple[int, int], dict[str, Any]] = {}
    for row in rows:
        first.setdefault((row["cpu_blocks"], row["ssd_blocks"]), row)
    hits = belady_hits(accesses, {row["cache_blocks"] for row in first.values()})
    out = []
    for point, row in first.items():
        n = hits[row["cache_blocks"]]
        out.append({"eviction": OPTIMAL, "admission": "always", "cpu_blocks": point[0], "ssd_blocks": point[1],
                    "gpu_blocks": row["gpu_blocks"], "set": [s for s in row["set"] if "capacity" in s],
                    "hit_rate": round(n / len(accesses), 6) if accesses else 0.0, "hit_rates": {},
                    "cache_blocks": row["cache_blocks"], "prefill_tokens_saved": n * block_size,
                    "prefill_flops_saved": None, "alpha": None,
                    "ssd_bytes_written": None, "ssd_bytes_per_hour": None, "drive_writes_per_day": None,
                    "admissions_rejected": 0, "policy_ns_per_op": None, "replay_s": None})
        out += [r for r in rows if (r["cpu_blocks"], r["ssd_blocks"]) == point]
    return out


def render_compare(report: dict[str, Any]) -> str:
    """The comparison as text: a block of rows per capacity point."""
    from kvstrata.system.values import plural

    lines = [f"kvstrata bench --compare: {plural(report['requests'], 'request')}, "
             f"{plural(report['distinct_blocks'], 'distinct block')}, GPU pool "
             f"{plural(report['gpu_blocks'], 'block')}; "
             f"{sum(r['eviction'] != OPTIMAL for r in report['rows'])} replays in {report['wall_s']:.1f} s", ""]
    if report.get("rejected_requests"):
        lines[1:1] = [f"  {plural(report['rejected_requests'], 'request')} rejected in every row (larger than "
                      "the GPU pool): raise gpu.num_blocks or gpu.capacity"]
    others = _other_tiers(report["rows"])
    head = (f"  {'eviction':<10}{'admission':<12}{'total':>8}"
            + "".join(f"{label(t):>8}" for t in (GPU, *LOWER, *others)) + f"{'FLOPs saved':>13}"
            f"{'SSD writes/h':>14}{'DWPD':>10}{'ns/op':>8}")
    same = True
    for (slab, store), rows in _by_point(report["rows"]):
        lines += [f"CPU tier {plural(slab, 'block')}, SSD tier {plural(store, 'block')}", head]
        policies = [r for r in rows if r["eviction"] != OPTIMAL]
        best = max((r["hit_rate"] for r in policies), default=0.0)
        same = same and len({(r["hit_rate"], r["ssd_bytes_written"]) for r in policies}) <= 1
        for r in rows:
            lines.append(_render_row(r, best, others))
        lines.append("")
    if same and report["rows"]:
        lines.append("Every row is the same: the GPU pool holds what the tiers below would; lower gpu.num_blocks "
                     "(or gpu.capacity) to compare them.")
    lines += ["Hit rate: blocks served from cache (prefix-contiguous) / blocks requested; * the best at that point.",
              "FLOPs saved: the hits' prefill compute, a later block costing more (its attention), estimated "
              "from model.*; cost:<alpha> was chosen by replaying the trace's first quarter.",
              "A row's `set` in --json reproduces it: kvstrata bench --set KEY=VALUE ... (the same trace and flags).",
              ""]
    return "\n".join(lines)


def _other_tiers(rows: Iterable[dict[str, Any]]) -> list[str]:
    """The tiers rows have hit rates of besides the device pool and the built-in local kinds
    (DRAM and SSD: a registered tier kind's), in their order."""
    return list(dict.fromkeys(t for r in rows for t in r["hit_rates"] if t not in (GPU, *LOWER)))


def _render_row(r: dict[str, Any], best: float, others: Sequence[str] = ()) -> str:
    if r["eviction"] == OPTIMAL:
        return (f"  {'optimal':<10}{'(offline)':<12}{r['hit_rate']:>8.2%}   the bound: Belady's MIN over "
                f"{r['cache_blocks']:,} blocks, any block hit counted")
    h = r["hit_rates"]
    mark = " *" if r["hit_rate"] == best else ""
    per_hour = format_size(r["ssd_bytes_per_hour"]) if r["ssd_bytes_per_hour"] is not None else "-"
    dwpd = f"{r['drive_writes_per_day']:.3g}" if r["drive_writes_per_day"] is not None else "-"
    eviction = r["eviction"] + (f":{r['alpha']:g}" if r.get("alpha") is not None else "")
    return (f"  {eviction:<10}{r['admission']:<12}{r['hit_rate']:>8.2%}"
            + "".join(f"{h.get(t, 0):>8.2%}" for t in (GPU, *LOWER, *others))
            + f"{r['prefill_flops_saved']:>13.3g}{per_hour:>14}{dwpd:>10}"
            f"{r['policy_ns_per_op']:>8.0f}{mark}")


def _by_point(rows: Iterable[dict[str, Any]]) -> list[tuple[tuple[int, int], list[dict[str, Any]]]]:
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["cpu_blocks"], r["ssd_blocks"]), []).append(r)
    return list(groups.items())
