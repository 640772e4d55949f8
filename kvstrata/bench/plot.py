"""PNG of a bench run: the miss-ratio curve and the reuse-gap vs idle-before-evict distributions."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.bench.capacity import SLAB_KIND, STORE_KIND
from kvstrata.bench.diagnose import label
from kvstrata.bench.stats import Quantiles
from kvstrata.policy.tiers import GPU

if TYPE_CHECKING:
    from kvstrata.bench.analysis import BenchResult

__all__ = ["plot_report", "plot_compare"]

_COLORS = {GPU: "tab:green", SLAB_KIND: "tab:blue", STORE_KIND: "tab:purple", "cache": "tab:red", "trace": "black"}
_OTHER_COLORS = ("tab:olive", "tab:cyan", "tab:brown", "tab:pink", "tab:gray")  # a registered kind's tiers


def _color(tier: str, tiers: tuple[str, ...]) -> str:
    """``tier``'s line color: a built-in tier's own, another's by its place among ``tiers``."""
    if tier in _COLORS:
        return _COLORS[tier]
    others = [t for t in tiers if t not in _COLORS]
    return _OTHER_COLORS[others.index(tier) % len(_OTHER_COLORS)]


def _ecdf_points(samples: Quantiles) -> tuple[Any, Any, float]:
    """``(x, fraction, zeros)``: the distribution's positive part (a log axis has no 0) and
    the fraction of samples that are 0 s, where the curve starts."""
    import numpy as np

    q = np.linspace(0.0, 1.0, min(samples.count, 1000))
    x = samples.quantiles(q)
    positive = x > 0
    zeros = float(q[positive][0]) if positive.any() else 1.0
    return x[positive], q[positive], zeros


def _ecdf(ax: Any, samples: Quantiles, label: str, color: str, style: str, **kw: Any) -> None:
    if not samples.count:
        return
    x, q, zeros = _ecdf_points(samples)
    if zeros >= 0.005:
        label += f" ({zeros:.0%} at 0 s)"
    if len(x):
        ax.step(x, q, where="post", label=label, color=color, linestyle=style, **kw)


def _mrc_panel(ax: Any, report: dict[str, Any]) -> None:
    pts = [p for p in report["mrc"] if p[0] > 0]
    ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], color="black", lw=1.8, label="exact LRU hit rate")
    ax.axhline(100 * report["ideal_hit_rate"], color="grey", ls=":", label="ideal (unbounded)")
    cap = report["capacity"]
    marks = [("GPU", cap[GPU]["tokens"], _COLORS[GPU]),
             ("GPU+CPU", cap[GPU]["tokens"] + cap[SLAB_KIND]["tokens"], _COLORS[SLAB_KIND]),
             ("all tiers", cap["effective_total_tokens"], _COLORS[STORE_KIND])]
    for name, tokens, color in marks:
        if tokens > 0:
            ax.axvline(tokens, color=color, ls="--", lw=1, label=f"{name}: {tokens:,} tokens")
    for t in report["recommendation"]["targets"]:
        if t["total_tokens"] > 0:
            ax.plot([t["total_tokens"]], [100 * t["hit_rate"]], "o", color="tab:orange")
            ax.annotate(f"{t['fraction_of_ideal']:.0%} of ideal", (t["total_tokens"], 100 * t["hit_rate"]),
                        textcoords="offset points", xytext=(6, -12), fontsize=8)
    if cap["effective_total_tokens"] > 0:
        ax.plot([cap["effective_total_tokens"]], [100 * report["hit_rate"]["total"]], "s", color="tab:red",
                label=f"tiered replay: {100 * report['hit_rate']['total']:.1f}%")
    ax.set_xscale("log")
    ax.set_ylim(0, 100)
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("hit rate (%)")
    ax.set_title("Miss-ratio curve (prefix hits, LRU)")
    ax.grid(True, which="both", ls=":", alpha=0.4)
    ax.legend(fontsize=7, loc="upper left")


def _same(a: Quantiles, b: Quantiles) -> bool:
    import numpy as np

    if a.count != b.count or not a.count:
        return False
    q = np.linspace(0.0, 1.0, 101)
    return bool(np.allclose(a.quantiles(q), b.quantiles(q)))


def _lifecycle_panel(ax: Any, res: "BenchResult") -> None:
    rp = res.replay
    cache_idle = rp.cache_idle_before_evict_s
    if not any(_same(rp.lifecycle(t, "idle_before_evict_s"), cache_idle) for t in rp.tiers):
        # first, wide and light: the last tier's own line, close to it, stays visible on top
        _ecdf(ax, cache_idle, "idle before evict (whole cache)", _COLORS["cache"], "-", lw=4, alpha=0.35)
    _ecdf(ax, res.stack.reuse_gaps, "reuse gap (trace)", _COLORS["trace"], "-")
    for tier in rp.tiers:
        idle, color = rp.lifecycle(tier, "idle_before_evict_s"), _color(tier, rp.tiers)
        _ecdf(ax, rp.lifecycle(tier, "reuse_gap_s"), f"reuse gap {label(tier)}", color, "-")
        same = _same(idle, cache_idle)  # the last tier: its evictions are the whole cache's (one line)
        _ecdf(ax, idle, f"idle before evict {label(tier)}" + (" = whole cache" if same else ""), color, "--")
    ax.axhline(0.5, color="grey", lw=0.6)
    ax.axhline(0.9, color="grey", lw=0.6)
    ax.set_xscale("log")
    ax.set_ylim(0, 1)
    ax.set_xlabel("seconds of trace time")
    ax.set_ylabel("fraction of samples")
    ax.set_title("Reuse gap (solid) vs idle before evict (dashed; whole cache: wide)")
    ax.grid(True, which="both", ls=":", alpha=0.4)
    if ax.get_legend_handles_labels()[0]:  # beside the panel: the curves fill it
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def plot_report(res: "BenchResult", report: dict[str, Any], path: str | Path) -> Path:
    """Write the two-panel PNG to ``path`` (matplotlib, Agg backend) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 5.2))
    try:
        _mrc_panel(left, report)
        _lifecycle_panel(right, res)
        fig.suptitle(f"kvstrata bench: {report['trace']['name']} ({report['requests']:,} requests, "
                     f"{report['block_tokens']}-token blocks)")
        return _save(fig, path)
    finally:
        plt.close(fig)


def _save(fig: Any, path: str | Path) -> Path:
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    return out


_ORDER_STYLE = {"lru": "tab:blue", "s3fifo": "tab:orange", "arc": "tab:green"}


def plot_compare(report: dict[str, Any], path: str | Path) -> Path:
    """``kvstrata bench --compare`` as a PNG: total hit rate (left) and SSD writes per hour
    (right) against the SSD tier's capacity, a line per eviction x admission, and the optimum."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
    try:
        bound = sorted(((r["ssd_blocks"], r["hit_rate"]) for r in rows if r["eviction"] == "optimal"),
                       key=lambda t: t[0])
        if bound:
            left.plot(*zip(*[(x, 100 * y) for x, y in bound]), color="black", ls=":", label="optimal (Belady)")
        for ev, color in _ORDER_STYLE.items():
            for adm, style in (("always", "-"), ("second_hit", "--")):
                pts = sorted(((r["ssd_blocks"], r) for r in rows if r["eviction"] == ev and r["admission"] == adm),
                             key=lambda t: t[0])
                if not pts:
                    continue
                xs = [x for x, _ in pts]
                left.plot(xs, [100 * r["hit_rate"] for _, r in pts], color=color, ls=style, marker="o",
                          label=f"{ev} / {adm}")
                right.plot(xs, [(r["ssd_bytes_per_hour"] or 0) / 2**30 for _, r in pts], color=color, ls=style,
                           marker="o", label=f"{ev} / {adm}")
        left.set(xlabel="SSD tier (blocks)", ylabel="prefix hit rate (%)", title="hit rate")
        right.set(xlabel="SSD tier (blocks)", ylabel="GiB written per hour", title="SSD writes")
        left.legend(fontsize=8)
        right.legend(fontsize=8)
        fig.suptitle(f"kvstrata bench --compare: {report['requests']:,} requests, "
                     f"{report['distinct_blocks']:,} distinct blocks")
        return _save(fig, path)
    finally:
        plt.close(fig)
