"""``kvstrata bench``'s other modes: ``--compare`` (every eviction x admission) and ``--replicas`` (a fleet)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvstrata.config.schema import plural
from kvstrata.system.files import write_json

__all__ = ["bench_compare", "bench_replicas", "refuse", "draw_plot"]


def draw_plot(draw: Any, *args: Any) -> None:
    """Draw a plot to its path (the last argument); a path that cannot be written is an error naming --plot."""
    from kvstrata.errors import ConfigError

    try:
        draw(*args)
    except OSError as e:
        raise ConfigError(f"--plot: {args[-1]}: {e.strerror or e}") from None


def refuse(mode: str, *flags: tuple[str, Any]) -> None:
    """A ReplayError naming the first of ``flags`` (``(flag, given)``) given with ``mode``."""
    from kvstrata.bench.replay import ReplayError

    for flag, given in flags:
        if given:
            raise ReplayError(f"{flag}: not with {mode}")


def bench_compare(args: argparse.Namespace, trace: Any, config: Any, options: Any, progress: Any) -> int:
    """``kvstrata bench --compare``: :mod:`kvstrata.bench.compare`."""
    from kvstrata.bench.compare import compare, render_compare

    try:
        report = compare(trace, config, options,
                         progress=progress.phase("replay", trace.num_requests) if args.trace is None else None)
    finally:
        progress.done()
    if report["skipped_lines"] and not args.quiet:
        print(f"kvstrata: skipped {plural(report['skipped_lines'], 'bad line')} (first: {report['first_skipped']})",
              file=sys.stderr)
    if args.plot:
        from kvstrata.bench.plot import plot_compare

        draw_plot(plot_compare, report, args.plot)
    if args.json:
        write_json(args.json, {"compare": report["rows"], **{k: v for k, v in report.items() if k != "rows"}})
    if not args.quiet and args.json != "-":
        sys.stdout.write(render_compare(report))
    return 0


def bench_replicas(args: argparse.Namespace, trace: Any, config: Any, options: Any, progress: Any) -> int:
    """``kvstrata bench --replicas N``: the fleets of :mod:`kvstrata.bench.replicas`."""
    from kvstrata.bench.replicas import ROUTINGS, render_replicas, replay_replicas, replicas_report

    routings = ROUTINGS if args.routing == "both" else (args.routing,)
    try:
        res = replay_replicas(trace, config, args.replicas, options, routings,
                              progress=progress.phase("replay", trace.num_requests) if args.trace is None else None)
    finally:
        progress.done()
    report = replicas_report(res)
    if args.json:
        write_json(args.json, report)
    if not args.quiet and args.json != "-":
        sys.stdout.write(render_replicas(report))
    return 0
