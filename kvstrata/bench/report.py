"""The bench report: a JSON-ready dict and its terminal rendering.

JSON keys (``kvstrata bench --json``): ``requests``, ``block_accesses``,
``block_tokens`` (tokens per block), ``distinct_blocks``, ``ideal_hit_rate``,
``hit_rate`` {gpu, cpu, ssd, total}, ``reuse_gap_s`` / ``idle_before_evict_s``
/ ``lifetime_s`` ({count, p50, p90, p99} for the whole cache plus ``tiers``
{gpu, cpu, ssd}; the top-level reuse gap is the trace's own time between
accesses of a block, the top-level idle and lifetime are of blocks leaving
the last tier), ``miss_reasons``, ``mrc`` ([capacity_tokens, hit_rate]
pairs), ``recommendation``, ``diagnosis``, ``capacity``, ``replay``,
``trace``, ``timings_s``, ``peak_rss_bytes`` (this process and, when the
miss-ratio pass ran in a child, that child).

Percentile summaries are exact while their samples take at most
:data:`~kvstrata.bench.stats.EXACT_VALUES` distinct values and within
:data:`~kvstrata.bench.stats.RELATIVE_ERROR` (relative) past that; each
summary's ``exact`` says which.
Per-tier entries are of the replay's tiers (:attr:`ReplayResult.tiers`; a registered
tier kind's under its declared name, ``evicted_<name>`` its miss reason); the text labels them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstrata.bench import diagnose
from kvstrata.bench.diagnose import label as _label
from kvstrata.bench.replay_result import persistent
from kvstrata.bench.stats import EXACT_VALUES, RELATIVE_ERROR, summarize
from kvstrata.config.schema import format_size, plural
from kvstrata.system.values import format_number, format_seconds
from kvstrata.policy.tiers import GPU, KNOWN, PERSISTENT

if TYPE_CHECKING:
    from kvstrata.bench.analysis import BenchResult
    from kvstrata.bench.replay import ReplayResult

__all__ = ["HIT_RATE_DEFINITION", "build_report", "render_text"]

HIT_RATE_DEFINITION = "blocks served from cache (prefix-contiguous) / blocks requested"
_LIFECYCLE = ("reuse_gap_s", "idle_before_evict_s", "lifetime_s")
_REASON_TEXT = {
    "new": "never seen before",
    "evicted_gpu": "evicted earlier from the GPU pool (no lower tier kept it)",
    "evicted_cpu": "evicted earlier from the CPU tier",
    "evicted_ssd": "evicted earlier from the SSD tier",
    "prefix_miss": "still cached, unreachable: an earlier block of the prompt missed",
    "last_token": "last prompt block (its last token is always computed)",
    "rejected": "the request needs more blocks than the whole GPU pool (rejected)",
    "other": "cached, yet not served (e.g. a failed lower-tier read)",
}


def _lifecycle(res: "BenchResult") -> dict[str, dict[str, Any]]:
    rp = res.replay
    top = {"reuse_gap_s": ("trace", res.stack.reuse_gaps),
           "idle_before_evict_s": ("cache", rp.cache_idle_before_evict_s),
           "lifetime_s": ("cache", rp.cache_lifetime_s)}
    out = {}
    for what, (scope, samples) in top.items():
        out[what] = {"scope": scope, **summarize(samples),
                     "tiers": {t: summarize(rp.lifecycle(t, what)) for t in rp.tiers}}
    return out


def _capacity(res: "BenchResult") -> dict[str, Any]:
    rp = res.replay
    bs, nbytes = rp.config.block_size, rp.config.block_nbytes()
    cap: dict[str, Any] = {t: {"blocks": n, "tokens": n * bs, "bytes": n * nbytes}
                           for t, n in rp.capacity_blocks.items()}
    cap["effective_total_tokens"] = diagnose.effective_capacity_blocks(rp.spec, rp.capacity_blocks) * bs
    cap["bytes_per_token"] = nbytes / bs
    cap["config_block_tokens"] = rp.config_block_size or bs  # the config's own unit (--set gpu.num_blocks)
    if rp.config.model.groups:
        cap["groups"] = rp.config.model.groups
    return cap


def _diagnosis(rates: dict[str, float], ideal: float, life: dict[str, dict[str, Any]],
               evictions: dict[str, int], forced: int, rejected: dict[str, Any],
               rp: "ReplayResult") -> dict[str, Any]:
    reuse = {t: life["reuse_gap_s"]["tiers"][t] for t in rp.tiers}
    reuse["trace"] = life["reuse_gap_s"]
    idle = {t: life["idle_before_evict_s"]["tiers"][t] for t in rp.tiers}
    idle["cache"] = life["idle_before_evict_s"]
    band = diagnose.hit_rate_band(rates["total"], ideal)
    pools = diagnose.pool_checks(reuse, idle, evictions, rp.miss_reasons, rp.accesses, rp.tiers)
    messages = [band["message"], *(pools[k]["message"] for k in (*rp.tiers, "cache"))]
    if forced:
        messages.append(f"{forced:,} running requests were finished early to make room: the GPU pool is smaller "
                        "than this trace's concurrency (see --decode-ms-per-token).")
    if rejected["requests"]:
        messages.append(f"{rejected['requests']:,} requests need more blocks than the whole GPU pool holds (up to "
                        f"{rejected['largest_tokens']:,} tokens) and were rejected, as an engine rejects them; "
                        f"their blocks count as misses. To admit them: {rejected['admit_with']}.")
    return {"hit_rate_band": band["band"], "pools": pools, "messages": messages}


def build_report(res: "BenchResult") -> dict[str, Any]:
    """Everything ``kvstrata bench`` reports, as plain JSON-ready values."""
    tr, rp, mrc = res.trace, res.replay, res.stack.mrc
    bs = tr.block_size
    rates = {k: round(v, 6) for k, v in rp.hit_rate().items()}
    life = _lifecycle(res)
    cap = _capacity(res)
    marks = [rp.capacity_blocks[GPU], rp.capacity_blocks[GPU] + rp.slab_blocks(),
             cap["effective_total_tokens"] // bs]
    evictions = dict(rp.stats.get("evictions", {}))
    return {
        "trace": {"name": tr.name, "format": tr.format, "duration_s": round(tr.duration_s, 3),
                  "skipped_lines": tr.skipped_lines, "notes": list(tr.notes)},
        "requests": tr.num_requests,
        "block_accesses": tr.num_accesses,
        "block_tokens": bs,
        "distinct_blocks": tr.num_distinct_blocks,
        "hit_rate_definition": HIT_RATE_DEFINITION,
        "ideal_hit_rate": round(mrc.ideal_hit_rate, 6),
        "hit_rate": rates,
        "hit_blocks": dict(rp.hit_blocks),
        **life,
        "miss_reasons": dict(rp.miss_reasons),
        "capacity": cap,
        "mrc": [[c * bs, round(h, 6)] for c, h in mrc.points(extra=marks)],
        "recommendation": diagnose.recommend(mrc, rp.config, rp.spec, rp.capacity_blocks),
        "diagnosis": _diagnosis(rates, mrc.ideal_hit_rate, life, evictions, rp.forced_frees, _rejected(rp), rp),
        "policy": {"admission": rp.spec.admission, "promotion": rp.spec.promotion,
                   "write_through": rp.spec.write_through, "pageout_blocks": rp.spec.pageout_blocks},
        "admission_comparison": {mode: _comparison(r, tr.duration_s) for mode, r in res.comparison.items()},
        "load_comparison": {p: _load_row(r) for p, r in res.load_comparison.items()},
        "replay": {"decode_s_per_token": res.options.decode_s_per_token, "payload": res.options.payload,
                   "payload_block_bytes": rp.payload_block_bytes, "forced_frees": rp.forced_frees,
                   "rejected": _rejected(rp),
                   "peak_running_requests": rp.peak_running, "wall_s": round(rp.wall_s, 3),
                   **{k: dict(rp.stats.get(k, {})) for k in ("spills", "promotions", "evictions",
                                                             "dropped_spills", "corrupt_blocks")},
                   "transfer": rp.stats.get("transfer", {})},
        "ssd_writes": persistent_writes(rp, tr.duration_s),
        "recording": _recording(res),
        "misses": rp.misses if res.options.explain else None,
        "timings_s": {k: round(v, 3) for k, v in res.timings_s.items()},
        "peak_rss_bytes": _peak_rss(res),
    }


def persistent_writes(rp: "ReplayResult", duration_s: float) -> dict[str, Any]:
    """What the SSD tier (the tier whose records persist on a drive) writes: bytes (blocks
    stored x block bytes, before compression), per hour of trace time, and the drive writes
    per day that is for ``ssd.capacity``."""
    written = rp.persistent_bytes_written()
    per_hour = written * 3600 / duration_s if duration_s > 0 else None
    cap = rp.config.ssd.capacity if rp.persistent_blocks() else 0
    return {"bytes": written, "bytes_per_hour": None if per_hour is None else round(per_hour),
            "capacity_bytes": cap,
            "drive_writes_per_day": round(per_hour * 24 / cap, 4) if per_hour is not None and cap else None}


def _recording(res: "BenchResult") -> dict[str, Any] | None:
    """A recorded trace's deployment, and what the plugin measured beside what the replay
    predicts: hit rates per tier (tokens served / prompt tokens) and SSD bytes written."""
    tr, rp = res.trace, res.replay
    header = tr.header or {}
    rec = header.get("recording")
    if not isinstance(rec, dict):
        return None
    out: dict[str, Any] = {"id": rec.get("id"), "sample": rec.get("sample", 1.0), "keyed": rec.get("keyed", False),
                           "engine": (header.get("deployment") or {}).get("engine"), "notes": list(tr.notes)}
    bs = rp.config.block_size
    predicted = {t: rp.hit_blocks.get(t, 0) * bs / rp.prompt_tokens if rp.prompt_tokens else 0.0
                 for t in rp.hit_blocks}
    predicted["total"] = sum(predicted.values())
    out["predicted"] = {"hit_rate": {k: round(v, 6) for k, v in predicted.items()},
                        "ssd_bytes_written": rp.persistent_bytes_written(),
                        "preempted_hit_tokens": sum(rp.preempted_hit_blocks.values()) * bs}
    body = tr.measured
    if body is None:
        out["measured"] = None
        out["why_no_measured"] = "no measured counters for the whole recording (a part is missing, or its " \
                                 "sidecar is)"
        return out
    m = body["measured"]
    tokens = _count(m, "queries", "tokens")
    hits = {t: _count(m, "hits", t, "tokens") for t in rp.hit_blocks if t in _part(m, "hits")}
    rates = {t: v / tokens if tokens else 0.0 for t, v in hits.items()}
    rates["total"] = sum(rates.values())
    nbytes = _count(m, "block_nbytes") or rp.config.block_nbytes()
    written = sum(_count(m, "spills", t) for t in PERSISTENT) * nbytes
    again = _part(m, "preempted", "hits")
    out["measured"] = {"hit_rate": {k: round(v, 6) for k, v in rates.items()}, "prompt_tokens": tokens,
                       "ssd_bytes_written": written, "recorder": _part(body, "recorder"),
                       "preempted_hit_tokens": sum(_count(again, t, "tokens") for t in again)}
    out["difference_pp"] = {t: round(100 * (predicted.get(t, 0.0) - rates[t]), 2) for t in rates}
    out["ssd_bytes_ratio"] = round(rp.persistent_bytes_written() / written, 4) if written else None
    return out


def _part(d: Any, *path: str) -> dict[str, Any]:
    """``d[path[0]][path[1]]...`` of a recording's measurements, {} where it is not a mapping
    (the file is another tenant's to write: nothing in it is trusted)."""
    for key in path:
        d = d.get(key) if isinstance(d, dict) else None
    return d if isinstance(d, dict) else {}


def _count(d: Any, *path: str) -> int:
    """A counter of a recording's measurements, 0 where it is not a non-negative integer."""
    v = _part(d, *path[:-1]).get(path[-1])
    return v if type(v) is int and 0 <= v < 1 << 62 else 0


def _peak_rss(res: "BenchResult") -> dict[str, int | None]:
    """Largest resident memory so far of this process and of the miss-ratio child (None: no child)."""
    import resource

    return {"analysis": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "curve_process": res.stack.peak_rss_bytes}


def _rejected(rp: "ReplayResult") -> dict[str, Any]:
    bs = rp.config.block_size
    return {"requests": rp.rejected, "largest_tokens": rp.rejected_max_blocks * bs, "admit_with": rp.admit_hint}


def _comparison(rp: "ReplayResult", duration_s: float) -> dict[str, Any]:
    """One admission mode's outcome: hit rates, blocks written per tier, SSD bytes written per hit
    (of any tier, and of the SSD tier's: the tiers whose records persist on a drive)."""
    stored = rp.stats.get("spills", {})
    written, own_hits = rp.persistent_bytes_written(), persistent(rp.hit_blocks)
    return {"hit_rate": {k: round(v, 6) for k, v in rp.hit_rate().items()},
            "hit_blocks": dict(rp.hit_blocks),
            "ssd_writes": persistent_writes(rp, duration_s),
            "blocks_written": {t: stored.get(t, 0) for t in rp.tiers if t != GPU},
            "ssd_bytes_written": written,
            "ssd_bytes_written_per_hit": round(written / rp.hits, 1) if rp.hits else None,
            "ssd_bytes_written_per_ssd_hit": round(written / own_hits, 1) if own_hits else None}


# ------------------------------------------------------------------ rendering

def _table(headers: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]

    def fmt(cells: list[str]) -> str:
        first = str(cells[0]).ljust(widths[0])
        rest = [str(c).rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return indent + "  ".join([first, *rest]).rstrip()

    return [fmt(headers), indent + "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)]


def _tiers(rates: dict[str, Any], shared: bool = True) -> list[str]:
    """The tiers of a ``hit_rate`` (its keys but ``total``); without ``shared``, the local ones."""
    return [t for t in rates if t != "total" and (shared or not (t in KNOWN and KNOWN[t].shared))]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _tier_rows(r: dict[str, Any]) -> list[list[str]]:
    """The hit-rate table: a row per tier, named by its label in capitals (as every tier column)."""
    rows = []
    for t in _tiers(r["hit_rate"]):
        c = r["capacity"][t]
        rows.append([_label(t).upper(), f"{c['blocks']:,}", f"{c['tokens']:,}", format_size(c["bytes"]),
                     _pct(r["hit_rate"][t]), f"{r['hit_blocks'][t]:,}"])
    rows.append(["total", "", f"{r['capacity']['effective_total_tokens']:,}", "", _pct(r["hit_rate"]["total"]),
                 f"{sum(r['hit_blocks'].values()):,}"])
    rows.append(["ideal (unbounded)", "", "", "", _pct(r["ideal_hit_rate"]), ""])
    return rows


def _life_rows(r: dict[str, Any]) -> tuple[list[list[str]], list[str]]:
    """The rows with samples, and ``what scope`` of those without (said in one line, not
    as rows of dashes)."""
    rows: list[list[str]] = []
    empty: list[str] = []
    names = {"reuse_gap_s": "reuse gap", "idle_before_evict_s": "idle before evict", "lifetime_s": "lifetime"}
    for what in _LIFECYCLE:
        d = r[what]
        first = True
        for scope, s in [(d["scope"], d), *d["tiers"].items()]:
            if not s["count"]:
                empty.append(f"{names[what]} {scope}")
                continue
            mark = "" if s.get("exact", True) else "~"
            rows.append([names[what] if first else "", scope,
                         *(format_seconds(s[p]) for p in ("p50", "p90", "p99")), f"{mark}{s['count']:,}"])
            first = False
    return rows, empty


def _summaries(r: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for what in _LIFECYCLE for s in (r[what], *r[what]["tiers"].values())]


def _mrc_rows(r: dict[str, Any], rows: int = 12) -> list[list[str]]:
    pts = [p for p in r["mrc"] if p[0] > 0]
    if len(pts) > rows:
        step = (len(pts) - 1) / (rows - 1)
        pts = [pts[round(i * step)] for i in range(rows)]
    per_token = r["capacity"]["bytes_per_token"]
    return [[f"{tok:,}", format_size(tok * per_token), _pct(rate)] for tok, rate in pts]


def _load_row(r: "ReplayResult") -> dict[str, Any]:
    """A ``load.policy``'s replay: its estimated TTFT and its decisions per tier."""
    assert r.load is not None and r.ttft_s is not None
    return {"mean_ttft_s": round(r.load["mean_ttft_s"], 6), "ttft_s": r.ttft_s.summary(),
            "hit_rate": {k: round(v, 6) for k, v in r.hit_rate().items()},
            "decisions": r.load["decisions"], "block_seconds": r.load["block_seconds"],
            "latency_seconds": r.load.get("latency_seconds", {}),
            "token_seconds": r.load["token_seconds"], "block_nbytes": r.config.block_nbytes()}


def _load_text_row(policy: str, c: dict[str, Any]) -> list[str]:
    ms = lambda s: "-" if s is None else f"{format_number(s * 1e3, ',.1f')} ms"  # noqa: E731
    decided = ", ".join(f"{t} {d['loaded']:,} ({d['recomputed']:,})" for t, d in c["decisions"].items()
                        if d["loaded"] or d["recomputed"])
    return [policy, ms(c["mean_ttft_s"]), ms(c["ttft_s"]["p50"]), ms(c["ttft_s"]["p99"]), decided or "-"]


def _load_figures(c: dict[str, Any]) -> str:
    """The figures a load comparison estimated from (``load.*``, or a recording's measurements)."""
    lat = c.get("latency_seconds", {})
    tiers = ", ".join(f"{_label(t)} {format_size(c['block_nbytes'] / s)}/s"
                      + (f" + {lat[t] * 1e3:,.2f} ms a load" if lat.get(t) else "")
                      for t, s in c["block_seconds"].items() if s > 0)
    return f"Figures: {tiers}; compute {format_number(1 / c['token_seconds'])} tokens/s"


def _comparison_row(mode: str, c: dict[str, Any]) -> list[str]:
    per_hit = c["ssd_bytes_written_per_hit"]
    return [mode, *(_pct(c["hit_rate"][t]) for t in (*_tiers(c["hit_rate"], shared=False), "total")),
            format_size(c["ssd_bytes_written"]), "-" if per_hit is None else format_size(per_hit)]


def _persistent_lines(w: dict[str, Any]) -> list[str]:
    if not w["capacity_bytes"]:
        return []
    if w["bytes_per_hour"] is None:
        return [f"  SSD writes: {format_size(w['bytes'])} (the trace spans no time: no rate)"]
    return [f"  SSD writes: {format_size(w['bytes_per_hour'])} per hour of trace time (before compression), "
            f"{w['drive_writes_per_day']:.3g} drive writes per day of the {format_size(w['capacity_bytes'])} SSD tier"]


def _recording_lines(rec: dict[str, Any], bs: int) -> list[str]:
    eng = rec.get("engine") or {}
    what = f"{eng.get('name', '?')} {eng.get('version', '')}".strip()
    out = [f"Recording {rec['id']} (served by {what}; "
           + ("hashes keyed with a secret" if rec.get("keyed") else "hashes not keyed") + ")"]
    if rec.get("sample", 1.0) < 1.0:
        out.append(f"  Sampled at {rec['sample']:g} of the requests: the replay sees only those, so its hit rates "
                   "are not comparable with what the plugin measured over all of them.")
        return out
    m = rec.get("measured")
    if m is None:
        out.append(f"  Measured by the plugin: none ({rec['why_no_measured']}).")
        return out
    pred = rec["predicted"]["hit_rate"]
    rows = [[_label(t).upper() if t != "total" else "total", _pct(m["hit_rate"][t]), _pct(pred.get(t, 0.0)),
             f"{rec['difference_pp'][t]:+.1f}"] for t in m["hit_rate"]]
    out += ["  Hit rates: prompt tokens served per tier / prompt tokens"]
    out += _table(["tier", "measured by the plugin", "predicted by this replay", "difference (points)"], rows)
    ratio = rec.get("ssd_bytes_ratio")
    out.append(f"  SSD bytes written: {format_size(m['ssd_bytes_written'])} measured, "
               f"{format_size(rec['predicted']['ssd_bytes_written'])} predicted"
               + (f" ({format_number(ratio, '.3f')}x)" if ratio is not None else ""))
    if m["preempted_hit_tokens"] or rec["predicted"]["preempted_hit_tokens"]:
        out.append(f"  Requests resumed after a preemption (not in the hit rates): "
                   f"{m['preempted_hit_tokens']:,} tokens served from cache measured, "
                   f"{rec['predicted']['preempted_hit_tokens']:,} predicted")
    rc = m.get("recorder") or {}
    if rc.get("dropped") or rc.get("unfinished"):
        out.append(f"  The recorder left out {rc.get('dropped', 0):,} requests (its queue was full) and "
                   f"{rc.get('unfinished', 0):,} still running at shutdown.")
    return out


_MISS_TEXT = {"new": "never seen before", "evicted_gpu": "evicted from the GPU pool",
              "evicted_cpu": "evicted from the CPU tier", "evicted_ssd": "evicted from the SSD tier",
              "rejected": "rejected: larger than the GPU pool", "other": "cached, yet not served",
              "last_token": "last prompt block"}


def _reason_text(reason: str, texts: dict[str, str], evicted: str) -> str:
    """``texts[reason]``, else for a tier's ``evicted_<name>``: ``evicted`` with its label."""
    tier = reason.removeprefix("evicted_")
    return texts.get(reason) or (evicted.format(_label(tier)) if tier != reason else reason)


def _miss_lines(misses: list[dict[str, Any]], limit: int = 20) -> list[str]:
    """Each request's first missed block (``--explain``; all of them in ``--json``)."""
    out = [f"First miss per request (--explain): {plural(len(misses), 'request')} missed a block they could have "
           "hit" + (f"; the first {limit}" if len(misses) > limit else "")]
    rows = []
    for m in misses[:limit]:
        why = _reason_text(m["reason"], _MISS_TEXT, "evicted from the {} tier")
        if "left_s_ago" in m:
            why += f" {format_seconds(m['left_s_ago'])} s before (last used {format_seconds(m['last_used_s_ago'])} s before)"
        rows.append([f"{m['request']:,}", f"{m['line']:,}" if m["line"] else "-", format_seconds(m["timestamp"]),
                     f"{m['hit']}/{m['hittable']}", why])
    out += _table(["request", "line", "arrival (s)", "hit / could hit", "first miss: why"], rows)
    return out


def render_text(r: dict[str, Any]) -> str:
    """The terminal report."""
    tr = r["trace"]
    out = [f"kvstrata bench: {tr['name']} ({tr['format']}, {r['block_tokens']}-token blocks)",
           f"  {r['requests']:,} requests over {format_number(tr['duration_s'])} s, "
           f"{r['block_accesses']:,} block accesses, "
           f"{r['distinct_blocks']:,} distinct blocks"
           + (f", {plural(tr['skipped_lines'], 'bad line')} skipped" if tr["skipped_lines"] else ""),
           f"  hit rate = {HIT_RATE_DEFINITION}", ""]
    notes = (r.get("recording") or {}).get("notes") or r["trace"].get("notes") or []
    if notes:
        out += ["Skipped while reading"] + [f"  {n}" for n in notes] + [""]
    out += ["Hit rate by tier"]
    if r["capacity"].get("groups"):
        out += [f"  a hybrid model, KV-cache groups {r['capacity']['groups']}: a block is one group's, a hit is of "
                "positions every group serves; tokens = blocks x block size, the miss-ratio curve counts positions"]
    out += _table(["tier", "blocks", "tokens", "bytes", "hit rate", "hits"], _tier_rows(r))
    out += _persistent_lines(r["ssd_writes"])
    if r.get("recording"):
        out += ["", *_recording_lines(r["recording"], r["block_tokens"])]
    own = r["capacity"].get("config_block_tokens", r["block_tokens"])
    if own != r["block_tokens"]:
        gpu = r["capacity"][GPU]["tokens"]
        out.append(f"  Blocks of this trace ({r['block_tokens']} tokens); the config counts blocks of {own} "
                   f"tokens (its GPU pool: {gpu // own:,} of them, {gpu:,} tokens).")
    out += ["", *_lifecycle_lines(r)]
    out += ["", "Why blocks missed"]
    n = r["block_accesses"] or 1
    out += _table(["reason", "blocks", "of accesses"],
                  [[_reason_text(k, _REASON_TEXT, "evicted earlier from the {} tier"), f"{v:,}", _pct(v / n)]
                   for k, v in r["miss_reasons"].items() if v])
    out += ["", "Exact LRU miss-ratio curve (one cache of this total capacity)"]
    out += _table(["capacity (tokens)", "KV bytes", "hit rate"], _mrc_rows(r))
    rec = r["recommendation"]
    out += ["", "Recommendation",
            f"  configured total ~{rec['configured_total_tokens']:,} tokens: an LRU cache that size serves "
            f"{_pct(rec['lru_hit_rate_at_configured'])}; the ideal {_pct(rec['ideal_hit_rate'])} needs "
            f"{rec['saturation_tokens']:,} tokens"]
    out += [f"  {t['message']}" for t in rec["targets"]]
    out += ["", "Diagnosis"] + [f"  {m}" for m in r["diagnosis"]["messages"]]
    if r["admission_comparison"]:
        out += ["", "Admission modes (the same trace and capacities)"]
        first = next(iter(r["admission_comparison"].values()))
        out += _table(["admission", *(_label(t) for t in _tiers(first["hit_rate"], shared=False)), "total",
                       "SSD writes", "SSD writes per hit (any tier)"],
                      [_comparison_row(m, c) for m, c in r["admission_comparison"].items()])
    if r.get("load_comparison"):
        out += ["", "Load or recompute: TTFT per request as the load.* figures estimate it (each request alone)"]
        out += _table(["load.policy", "mean", "P50", "P99", "hits loaded (recomputed) per tier"],
                      [_load_text_row(p, c) for p, c in r["load_comparison"].items()])
        out.append("  " + _load_figures(next(iter(r["load_comparison"].values()))))
    if r.get("misses") is not None:
        out += ["", *_miss_lines(r["misses"])]
    out += _replay_lines(r)
    out += ["Timings: " + ", ".join(f"{k} {v:.2f} s" for k, v in r["timings_s"].items())]
    return "\n".join(out) + "\n"


def _lifecycle_lines(r: dict[str, Any]) -> list[str]:
    out = ["Block lifecycle (seconds of trace time)"]
    life_rows, no_samples = _life_rows(r)
    out += _table(["", "scope", "P50", "P90", "P99", "samples"], life_rows)
    if no_samples:
        out.append(f"  No samples (nothing reused or evicted there): {', '.join(no_samples)}.")
    if not all(s.get("exact", True) for s in _summaries(r)):
        out += [f"  ~: samples of more than {EXACT_VALUES:,} distinct values: percentiles within "
                f"{100 * RELATIVE_ERROR:g}% of exact"]
    return out


def _replay_lines(r: dict[str, Any]) -> list[str]:
    out: list[str] = []
    rp = r["replay"]
    pol = r["policy"]
    out += ["", f"Policy: {pol['admission']} admission, {pol['promotion']} promotion, write-through "
                f"{'on' if pol['write_through'] else 'off'}"
            + (f", page-out window {pol['pageout_blocks']:,} blocks" if pol["pageout_blocks"] else "")]
    out += [f"Replay: {rp['peak_running_requests']} requests running at peak, decode "
                f"{1000 * rp['decode_s_per_token']:g} ms/token, {rp['forced_frees']:,} finished early"
            + (f"; payload {format_size(rp['payload_block_bytes'])} per block" if rp["payload"] else "")
            + (f"; {rp['rejected']['requests']:,} requests rejected (larger than the GPU pool)"
               if rp["rejected"]["requests"] else "")]
    if rp["payload"]:
        moved = [f"{d} {format_size(v['bytes'])} in {v['seconds']:.2f} s" for d, v in rp["transfer"].items()
                 if v.get("bytes")]
        out += [f"Payload: real bytes moved through the CPU slab and the SSD tier ({format_size(rp['payload_block_bytes'])}"
                " per block; times are copy and storage costs at that block size): " + ("; ".join(moved) or "none")]
    return out
