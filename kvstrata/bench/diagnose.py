"""The operator-facing verdicts: hit-rate bands, pool-size checks, tier sizing.

Hit-rate bands and the pool-size rule follow the seed's section 6.4: a
prefix hit rate above 0.7 is healthy, 0.3-0.7 is fair, below 0.1 is a
problem when the traffic shares prefixes and normal when it does not; and
``reuse_gap`` P90 above ``idle_before_evict`` P50 means blocks are usually
evicted before they are reused, i.e. the pool is too small.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from kvstrata.bench.capacity import SLAB_KIND, STORE_KIND
from kvstrata.config.schema import format_size
from kvstrata.policy.events import TIERS
from kvstrata.policy.tiers import GPU, KNOWN

if TYPE_CHECKING:
    from kvstrata.bench.mrc import MissRatioCurve
    from kvstrata.config.schema import KVStrataConfig
    from kvstrata.policy import PolicySpec

__all__ = ["hit_rate_band", "pool_checks", "recommend", "effective_capacity_blocks", "label"]

_GROW = {
    GPU: "grow the GPU KV pool: raise gpu_memory_utilization, lower max_model_len or use an FP8 KV cache "
           "(`kvstrata plan` shows the effect), or add a larger CPU tier below it",
    "cache": "give the tiers more capacity (see the recommendation)",
}


def label(tier: str) -> str:
    """How text names ``tier``: its declaration's ``label`` (a kind registered now), else its
    name in capitals (the device pool: ``GPU``)."""
    known = KNOWN.get(tier)
    return known.label if known is not None and known.label else tier.upper()


def _grow(scope: str) -> str:
    """What an operator raises to grow ``scope`` (a tier or the whole cache): its
    declaration's ``hint`` for a tier below the device."""
    if scope in _GROW:
        return _GROW[scope]
    known = KNOWN.get(scope)
    return known.hint if known is not None and known.hint else f"give the {label(scope)} tier more capacity"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _capacity_note(rate: float, ideal: float) -> str:
    if ideal > 0 and rate >= 0.95 * ideal:
        return " The cache reaches that: the other misses are first-time blocks, not a capacity problem."
    return " The difference is capacity: see the recommendation."


def hit_rate_band(rate: float, ideal: float) -> dict[str, str]:
    """The seed's hit-rate bands, with the unbounded-cache rate to tell 'no shared prefixes' apart."""
    reach = f" An unbounded cache would serve {_pct(ideal)}."
    if rate > 0.7:
        return {"band": "healthy", "message": f"Hit rate {_pct(rate)} is healthy: normal for multi-turn chat and "
                "fixed system prompts. Nothing to do."}
    if rate >= 0.3:
        return {"band": "fair", "message": f"Hit rate {_pct(rate)} is fair: variable content may sit in front of "
                "the shared part of the prompts; check the prompt template order (fixed text first, "
                "variable text last)." + reach + _capacity_note(rate, ideal)}
    if rate >= 0.1:
        return {"band": "low", "message": f"Hit rate {_pct(rate)} is low (between the 0.1 and 0.3 bands)."
                + reach + (" The gap is capacity: see the recommendation." if ideal >= 2 * rate else
                           " The traffic itself shares little.")}
    if ideal >= 0.1:
        return {"band": "problem", "message": f"Hit rate {_pct(rate)} is a problem: the traffic shares prefixes"
                f" (an unbounded cache would serve {_pct(ideal)}). Check that replicas are not routed at random,"
                " that the KV pool is not so small that blocks are evicted before reuse, and that prompts do"
                " not start with a timestamp or uuid."}
    return {"band": "no_shared_prefixes", "message": f"Hit rate {_pct(rate)} is normal for this traffic: it has "
            f"almost no shared prefixes (an unbounded cache would serve {_pct(ideal)}). Prefix caching cannot "
            "help; do not spend time tuning it."}


# Where a tier's evicted blocks are served from when the tiers below hold them all.
_FASTER = {GPU: "without a load", SLAB_KIND: "from DRAM instead of the SSD"}


def pool_check(scope: str, reuse_p90: float | None, idle_p50: float | None, evictions: int, *,
               held_below: bool = False, missed: int = 0, accesses: int = 0) -> dict[str, Any]:
    """Verdict for one tier (or the whole cache): reuse-gap P90 vs idle-before-evict P50.
    ``held_below``: the tiers below hold every block this one evicts (the whole cache
    evicted nothing), so a tier too small costs loads from below, not hits. ``missed``:
    accesses that missed because this tier, the last to hold the block, evicted it (of
    ``accesses``): a tier large enough for most reuses says what it still lost."""
    out: dict[str, Any] = {"reuse_gap_p90_s": reuse_p90, "idle_before_evict_p50_s": idle_p50,
                           "evictions": evictions, "held_below": held_below, "missed": missed}
    name = label(scope) if scope != "cache" else "Whole cache"
    if evictions == 0:
        out.update(verdict="no_evictions", message=f"{name}: nothing was evicted; it holds all it was given.")
    elif reuse_p90 is None or idle_p50 is None:
        out.update(verdict="not_enough_samples",
                   message=f"{name}: too few reuses or evictions to compare reuse gap and idle time.")
    elif reuse_p90 > idle_p50 and held_below and scope in _FASTER:
        out.update(verdict="too_small_held_below", message=(
            f"{name}: too small for its reuse gaps (P90 {reuse_p90:.1f} s > idle-before-evict P50 "
            f"{idle_p50:.1f} s), but the tiers below hold every block it evicts: this costs loads, not "
            f"hits. To serve those reuses {_FASTER[scope]}: {_grow(scope)}."))
    elif reuse_p90 > idle_p50:
        out.update(verdict="too_small", message=(
            f"{name}: too small. Reuse gap P90 {reuse_p90:.1f} s > idle-before-evict P50 {idle_p50:.1f} s: "
            f"blocks are usually evicted before they are reused; {_grow(scope)}."))
    elif missed:
        out.update(verdict="ok", message=(
            f"{name}: large enough for most reuses (reuse gap P90 {reuse_p90:.1f} s <= idle-before-evict "
            f"P50 {idle_p50:.1f} s), but {missed:,} accesses ({_pct(missed / max(accesses, 1))}) missed "
            f"blocks it evicted, the longest reuses ('evicted earlier' under 'Why blocks missed')."))
    else:
        out.update(verdict="ok", message=(
            f"{name}: large enough. Reuse gap P90 {reuse_p90:.1f} s <= idle-before-evict P50 "
            f"{idle_p50:.1f} s: blocks usually outlive their reuse gap."))
    return out


def pool_checks(reuse: dict[str, dict[str, Any]], idle: dict[str, dict[str, Any]],
                evictions: dict[str, int], missed: dict[str, int] | None = None,
                accesses: int = 0, tiers: Sequence[str] = TIERS) -> dict[str, dict[str, Any]]:
    """:func:`pool_check` for each of ``tiers`` (the replay's, the device first) and for the
    whole cache (``reuse['trace']`` vs ``idle['cache']``). ``missed``: the replay's miss
    reasons (``evicted_<tier>``: the tier was the last to hold it)."""
    out = {}
    missed = missed or {}
    held_below = idle["cache"]["count"] == 0  # nothing left the whole cache
    for tier in tiers:
        out[tier] = pool_check(tier, reuse[tier]["p90"], idle[tier]["p50"], evictions.get(tier, 0),
                               held_below=held_below, missed=missed.get(f"evicted_{tier}", 0), accesses=accesses)
    lost = sum(missed.get(f"evicted_{t}", 0) for t in tiers)
    out["cache"] = pool_check("cache", reuse["trace"]["p90"], idle["cache"]["p50"], idle["cache"]["count"],
                              missed=lost, accesses=accesses)
    return out


def effective_capacity_blocks(spec: "PolicySpec", caps: dict[str, int]) -> int:
    """Distinct blocks the hierarchy can hold (approx.; the policy's own rule)."""
    return spec.effective_blocks(caps[GPU])


def _target(mrc: "MissRatioCurve", cfg: "KVStrataConfig", caps: dict[str, int], frac: float) -> dict[str, Any]:
    """The capacities that reach ``frac`` of the ideal hit rate: in the device pool and below it,
    in the DRAM slab alone or in the persistent store beside the configured slab."""
    bs, nbytes = cfg.block_size, cfg.block_nbytes()
    goal = frac * mrc.ideal_hit_rate
    total = mrc.capacity_for(goal) or 0
    below = max(0, total - caps[GPU])
    slab, store = caps[SLAB_KIND], caps[STORE_KIND]
    in_store = below if cfg.spill.write_through else max(0, below - slab)
    t = {"fraction_of_ideal": frac, "hit_rate": round(mrc.hit_rate(total), 6), "total_tokens": total * bs,
         "total_bytes": total * nbytes, "gpu_tokens": caps[GPU] * bs, "below_gpu_tokens": below * bs,
         "cpu_capacity_bytes": below * nbytes, "ssd_capacity_bytes": in_store * nbytes}
    head = f"{frac:.0%} of ideal ({_pct(t['hit_rate'])}): {total * bs:,} tokens in total"
    if below == 0:
        t["message"] = f"{head}; the GPU pool alone is enough."
    elif below <= slab or (in_store <= store and store):
        t["message"] = (f"{head}; {below * bs:,} tokens below the GPU pool, which the configured "
                        f"{KNOWN[SLAB_KIND if below <= slab else STORE_KIND].label} tier already holds.")
    else:
        t["message"] = (f"{head} ({format_size(total * nbytes)} of KV). Below the GPU pool put {below * bs:,} "
                        f"tokens: --set cpu.capacity={_size_arg(below * nbytes)}, or keep the CPU tier and "
                        f"--set ssd.capacity={_size_arg(in_store * nbytes)}"
                        + (" (write-through: the SSD tier holds every spilled block)." if cfg.spill.write_through
                           else "."))
    return t


def _size_arg(nbytes: int) -> str:
    """A ``--set`` size rounded up: whole GiB from 1 GiB, whole MiB below."""
    if nbytes >= 1024**3:
        return f"{-(-nbytes // 1024**3)}GiB"
    return f"{max(1, -(-nbytes // 1024**2))}MiB"


def recommend(mrc: "MissRatioCurve", cfg: "KVStrataConfig", spec: "PolicySpec", caps: dict[str, int]) -> dict[str, Any]:
    """Capacities reaching 90% and 99% of the ideal hit rate, split between the GPU pool and the tiers below."""
    configured = effective_capacity_blocks(spec, caps)
    return {
        "ideal_hit_rate": round(mrc.ideal_hit_rate, 6),
        "configured_total_tokens": configured * cfg.block_size,
        "lru_hit_rate_at_configured": round(mrc.hit_rate(configured), 6),
        "saturation_tokens": mrc.saturation_blocks * cfg.block_size,
        "targets": [_target(mrc, cfg, caps, f) for f in (0.9, 0.99)],
    }
