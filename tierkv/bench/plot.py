"""PNG of a bench run: the miss-ratio curve and the reuse-gap vs idle-before-evict distributions."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierkv.bench.replay import TIERS
from tierkv.bench.stats import Quantiles

if TYPE_CHECKING:
    from tierkv.bench.analysis import BenchResult

__all__ = ["plot_report"]

_COLORS = {"gpu": "tab:green", "cpu": "tab:blue", "ssd": "tab:purple", "cache": "tab:red", "trace": "black"}


def _ecdf(ax: Any, samples: Quantiles, label: str, color: str, style: str) -> None:
    import numpy as np

    if not samples.count:
        return
    q = np.linspace(0.0, 1.0, min(samples.count, 1000))
    x = np.maximum(samples.quantiles(q), 1e-3)
    ax.step(x, q, where="post", label=label, color=color, linestyle=style)


def _mrc_panel(ax: Any, report: dict[str, Any]) -> None:
    pts = [p for p in report["mrc"] if p[0] > 0]
    ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], color="black", lw=1.8, label="exact LRU hit rate")
    ax.axhline(100 * report["ideal_hit_rate"], color="grey", ls=":", label="ideal (unbounded)")
    cap = report["capacity"]
    marks = [("GPU", cap["gpu"]["tokens"], _COLORS["gpu"]),
             ("GPU+CPU", cap["gpu"]["tokens"] + cap["cpu"]["tokens"], _COLORS["cpu"]),
             ("all tiers", cap["effective_total_tokens"], _COLORS["ssd"])]
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


def _lifecycle_panel(ax: Any, res: "BenchResult") -> None:
    rp = res.replay
    _ecdf(ax, res.stack.reuse_gaps, "reuse gap (trace)", _COLORS["trace"], "-")
    for tier in TIERS:
        _ecdf(ax, rp.lifecycle(tier, "reuse_gap_s"), f"reuse gap {tier.upper()}", _COLORS[tier], "-")
        _ecdf(ax, rp.lifecycle(tier, "idle_before_evict_s"), f"idle before evict {tier.upper()}",
              _COLORS[tier], "--")
    _ecdf(ax, rp.cache_idle_before_evict_s, "idle before evict (whole cache)", _COLORS["cache"], "--")
    ax.axhline(0.5, color="grey", lw=0.6)
    ax.axhline(0.9, color="grey", lw=0.6)
    ax.set_xscale("log")
    ax.set_ylim(0, 1)
    ax.set_xlabel("seconds of trace time")
    ax.set_ylabel("fraction of samples")
    ax.set_title("Reuse gap (solid) vs idle before evict (dashed)")
    ax.grid(True, which="both", ls=":", alpha=0.4)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="lower right")


def plot_report(res: "BenchResult", report: dict[str, Any], path: str | Path) -> Path:
    """Write the two-panel PNG to ``path`` (matplotlib, Agg backend) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    try:
        _mrc_panel(left, report)
        _lifecycle_panel(right, res)
        fig.suptitle(f"tierkv bench: {report['trace']['name']} ({report['requests']:,} requests, "
                     f"{report['block_tokens']}-token blocks)")
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out
