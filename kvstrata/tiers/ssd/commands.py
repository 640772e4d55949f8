"""``kvstrata ssd``: the operator's commands on an SSD tier directory (stats, verify, purge),
which the SSD kind registers as its ``commands``.

Read-only unless asked (``verify --drop``, ``purge``); the reports render what
:mod:`kvstrata.tiers.ssd.inventory` reads. Before either changes anything, every tier
at the path must prove to be one (:func:`~kvstrata.tiers.ssd.directory.check_environment`):
one that does not is refused in one line and nothing anywhere is changed.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from kvstrata.config.schema import plural
from kvstrata.system.files import write_json

__all__ = ["add_commands", "cmd_inspect", "cmd_purge", "parse_duration"]


def add_commands(sub: Any) -> None:
    """``kvstrata ssd stats|verify|purge`` on the top-level parser's subcommands."""
    ssd = sub.add_parser("ssd", help="what an SSD tier directory holds (read-only)")
    ssd_sub = ssd.add_subparsers(dest="ssd_command", required=True)
    for name, helptext in (("stats", "records, bytes, compression, namespaces, slack"),
                           ("verify", "read every record and check it as a read does (not while a server "
                                      "holds the tier)")):
        cmd = ssd_sub.add_parser(name, help=helptext)
        cmd.add_argument("path", metavar="PATH", help="an SSD tier directory, or a vLLM ssd.path holding rank-<r>")
        cmd.add_argument("--json", metavar="PATH", help="write the figures as JSON ('-' for stdout)")
        if name == "verify":
            cmd.add_argument("--drop", action="store_true", help="delete the records that do not verify")
        cmd.set_defaults(func=cmd_inspect, verify=name == "verify", drop=False)
    purge = ssd_sub.add_parser("purge", help="delete every record of one namespace (a retired model version); "
                                              "not while a server holds the tier")
    purge.add_argument("path", metavar="PATH", help="an SSD tier directory, or a vLLM ssd.path holding rank-<r>")
    which = purge.add_mutually_exclusive_group(required=True)
    which.add_argument("--namespace", metavar="PREFIX|FINGERPRINT",
                       help="the namespace as `kvstrata ssd stats` shows it (its prefix, 8 hex digits or more, "
                            "or its fingerprint)")
    which.add_argument("--older-than", type=parse_duration, metavar="DURATION",
                       help="records unused for at least this long (30m, 12h, 7d; known to the minute)")
    which.add_argument("--all-but", action="append", metavar="PREFIX|FINGERPRINT",
                       help="every namespace but this one (repeat to keep several): the current model's")
    which.add_argument("--all", action="store_true",
                       help="every block of every namespace: the tier's files are deleted (also a tier "
                            "written under kvstrata's previous name)")
    purge.set_defaults(func=cmd_purge)


def cmd_inspect(args: argparse.Namespace) -> int:
    """``kvstrata ssd stats|verify PATH``: read-only; exit 1 when verify found bad records."""
    from kvstrata.errors import ConfigError
    from kvstrata.tiers.ssd.directory import CHANGE
    from kvstrata.tiers.ssd.inventory import held_by, inventory, tier_dirs

    tiers = tier_dirs(args.path)
    if args.drop:
        _prove(tiers, CHANGE, "ssd verify --drop")
    if args.verify:
        for path in tiers:
            pid = held_by(path)
            if pid is not None:
                raise ConfigError(f"{path}: in use by {'process %d' % pid if pid > 0 else 'another process'}; "
                                  "verify reads every record: stop the server first (a read there already "
                                  "verifies and drops what does not)")
    reports = [inventory(path, verify=args.verify) for path in tiers]
    if args.drop:
        for r in reports:
            if "verify" in r:  # (an unreadable page file verified nothing, so nothing is dropped)
                r["verify"]["dropped"] = _drop_bad(Path(r["path"]), r)
    if args.json:
        write_json(args.json, {"tiers": reports})
    if args.json != "-":
        sys.stdout.write("".join(_render_tier(r) for r in reports))
    return 1 if any(r.get("verify", {}).get("bad") and not args.drop for r in reports) else 0


def _prove(tiers: list[Path], purpose: str, command: str) -> None:
    """Every tier of ``tiers`` is a kvstrata tier for ``purpose``, before any is changed."""
    from kvstrata.tiers.ssd.directory import check_environment

    for path in tiers:
        check_environment(path, command, purpose=purpose)


def _drop_bad(path: Path, report: dict[str, Any]) -> int:
    """Delete what ``verify`` found bad in the tier at ``path``; the records deleted."""
    from kvstrata.tiers.ssd.admin import delete_records

    by_prefix = {ns["prefix"]: ns for ns in report["namespaces"]}
    dropped = 0
    for prefix, keys in report["verify"]["bad_keys"].items():
        if prefix in by_prefix:
            dropped += delete_records(path, by_prefix[prefix], [bytes.fromhex(k) for k in keys],
                                      report["used_bytes"] or 0)
    return dropped


def cmd_purge(args: argparse.Namespace) -> int:
    """``kvstrata ssd purge PATH --namespace N | --all-but N... | --older-than D | --all``, in each tier at PATH."""
    from kvstrata.tiers.ssd.admin import delete_records, find_namespace
    from kvstrata.tiers.ssd.directory import CHANGE, PURGE
    from kvstrata.tiers.ssd.inventory import inventory, tier_dirs

    tiers = tier_dirs(args.path)
    _prove(tiers, PURGE if args.all else CHANGE, "ssd purge")
    if args.all:
        from kvstrata.tiers.ssd.admin import purge_all
        for path in tiers:
            files = purge_all(path)
            print(f"{path}: deleted every block ({', '.join(files) or 'no files'})")
        return 0
    for path in tiers:
        report = inventory(path, older_than=args.older_than)
        if args.namespace is not None or args.all_but:
            keep = {find_namespace(report, name, "--all-but")["prefix"] for name in args.all_but or ()}
            drop = ([find_namespace(report, args.namespace)] if args.namespace is not None else
                    [ns for ns in report["namespaces"] if ns["prefix"] not in keep and ns["records"]])
            for ns in drop:
                n = delete_records(path, ns, None, report["used_bytes"] or 0)
                print(f"{path}: deleted {plural(n, 'record')} of {ns['prefix'][:16]} ({ns.get('fingerprint', '?')})")
            continue
        by_prefix = {ns["prefix"]: ns for ns in report["namespaces"]}
        n = sum(delete_records(path, by_prefix[p], [bytes.fromhex(k) for k in keys], report["used_bytes"] or 0)
                for p, keys in report["old_keys"].items() if p in by_prefix)
        print(f"{path}: deleted {plural(n, 'record')} unused for at least {args.older_than:,.0f} s")
    return 0


def parse_duration(text: str) -> float:
    """An argparse type: ``90s``, ``30m``, ``12h``, ``7d`` (seconds when no unit)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    body, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "s")
    try:
        value = float(body) * units[unit]
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a duration such as 30m, 12h or 7d, got {text!r}")
    return value


def _idle_line(r: dict[str, Any]) -> str:
    from kvstrata.system.values import format_seconds as sec

    idle = r.get("idle_at_least_s") or {}
    if idle.get("p50") is None:
        return "not known (no time marks: written by an older kvstrata, or never written since)"
    return (f"at least P50 {sec(idle['p50'])} s, P90 {sec(idle['p90'])} s, the oldest {sec(idle['max'])} s "
            "(since each record's last use, to the minute)")


def _render_tier(r: dict[str, Any]) -> str:
    import datetime as dt

    from kvstrata.config.schema import format_size

    def when(t: float | None) -> str:
        return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC") if t else "-"

    files = r["files"]
    disk = sum(files.values())
    lines = [f"SSD tier {r['path']}" + (f" (in use by process {r['held_by']})" if (r["held_by"] or 0) > 0
                                        else " (in use)" if r["held_by"] else "")]
    if r["format"] != r["reads"]:
        lines.append(f"  record format {r['format']}: older than this kvstrata's ({r['reads']}); a tier opening "
                     "this directory discards its records")
    ratio = r["logical_bytes"] / r["stored_bytes"] if r["stored_bytes"] else None
    slack = max(0, files.get("blocks.dat", 0) - r["page_bytes"])
    rows = [("records", f"{r['records']:,}" + (f" ({plural(r['unreadable_heads'], 'unreadable header')})"
                                                 if r["unreadable_heads"] else "")),
            ("blocks", f"{format_size(r['logical_bytes'])} as stored blocks; {format_size(r['stored_bytes'])} "
                       f"after compression" + (f" (ratio {ratio:.2f})" if ratio else "")),
            ("on disk", f"{format_size(disk)}: index {format_size(files.get('data.mdb', 0))}, page file "
                        f"{format_size(files.get('blocks.dat', 0))} ({format_size(slack)} of it free or slack)"),
            ("created", when(r.get("created_at"))),
            ("unused for", _idle_line(r))]
    width = max(len(k) for k, _ in rows)
    lines += [f"  {k:<{width}}  {v}" for k, v in rows]
    if r["namespaces"]:
        lines.append("  namespaces (what wrote the records, since its first write):")
        for ns in r["namespaces"]:
            lines.append(f"    {ns['prefix'][:16]}  {ns['records']:>10,} records  "
                         f"{format_size(ns['logical_bytes']):>10}  since {when(ns.get('created_at'))}  "
                         f"{ns.get('fingerprint', '?')}")
    if "verify" in r:
        v = r["verify"]
        why = ", ".join(f"{n:,} {k}" for k, n in sorted(v["bad_by_reason"].items()))
        dropped = v.get("dropped")
        lines.append(f"  verify: {v['checked']:,} records read, {plural(v['bad'], 'bad record')}"
                     + (f" ({why}); " if v["bad"] else "")
                     + ("" if not v["bad"] else f"deleted {dropped:,}" if dropped is not None
                        else "a server deletes each when it reads it (or --drop)"))
    return "\n".join(lines) + "\n\n"


# ----------------------------------------------------------------- parser
