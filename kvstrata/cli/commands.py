"""``kvstrata`` command line: ``bench`` (size a tiered cache from traffic), ``plan`` (KV memory), ``inspect``
(a trace alone), ``ssd stats | verify`` (what an SSD tier directory holds).

Exit status: 0 success; 1 when ``ssd verify`` found records that do not verify;
2 bad input (missing or malformed trace, bad config or flag, a directory that is
not a tier), reported as one ``kvstrata: error: ...`` line on stderr; 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import stat
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, TextIO

from kvstrata.config.schema import plural
from kvstrata.cli.arguments import MAX_DISTINCT_HELP, MAX_SCALE, block_bytes, count, finite, positive_int
from kvstrata.system.files import write_json
from kvstrata.cli.bench_modes import draw_plot
from kvstrata.cli.generate import cmd_generate
from kvstrata.policy.spec import ADMISSIONS

if TYPE_CHECKING:
    from kvstrata.trace.reader import DistinctLimit

__all__ = ["main", "build_parser"]


# ---------------------------------------------------------------- progress

def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


class Progress:
    """A one-line progress bar on stderr, shown only once a phase has run for ``delay`` seconds."""

    def __init__(self, enabled: bool, stream: TextIO = sys.stderr, delay: float = 1.0) -> None:
        self.enabled, self.stream, self.delay = enabled, stream, delay
        self._label, self._total, self._t0, self._last, self._shown = "", 0, 0.0, 0.0, False

    def phase(self, label: str, total: int) -> Callable[[int], None]:
        """Start a phase of ``total`` steps; returns ``update(steps done)``."""
        self._start(label, total)
        return self.update

    def reading(self, label: str, size: int | None) -> Callable[[int, int], None]:
        """Start a phase that reads a stream; returns ``update(lines, bytes)``. ``size``: the
        stream's bytes when known (a regular file), else only what was read is shown."""
        self._start(label, size or 0)
        return self.update_read

    def update(self, n: int) -> None:
        frac = min(1.0, n / self._total) if self._total else 0.0
        self._show(f"[{'#' * int(30 * frac):<30}] {100 * frac:5.1f}% {n:,}/{self._total:,}")

    def update_read(self, lines: int, nbytes: int) -> None:
        if not self._total:
            self._show(f"{lines:,} lines, {_mib(nbytes)}")
            return
        frac = min(1.0, nbytes / self._total)
        self._show(f"[{'#' * int(20 * frac):<20}] {100 * frac:5.1f}% {lines:,} lines, {_mib(nbytes)}")

    def _start(self, label: str, total: int) -> None:
        self.done()
        self._label, self._total, self._t0, self._last = label, total, time.monotonic(), 0.0

    def _show(self, text: str) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._t0 < self.delay or now - self._last < 0.1:
            return
        self._last, self._shown = now, True
        self.stream.write(f"\r{self._label:<8} {text} {now - self._t0:5.1f} s")
        self.stream.flush()

    def done(self) -> None:
        if self._shown:
            self.stream.write("\r" + " " * 79 + "\r")
            self.stream.flush()
            self._shown = False


# ------------------------------------------------------------------ bench

def _load_config(args: argparse.Namespace) -> Any:
    from kvstrata.bench.deployment import default_config
    from kvstrata.config.schema import KVStrataConfig

    overrides = list(args.set or [])
    if getattr(args, "admission", None) in ADMISSIONS:  # the flag decides, before checks
        overrides.append(f"spill.admission={args.admission}")
    if args.config:
        return KVStrataConfig.from_yaml(args.config, overrides)
    deployment = _recorded_deployment(args)
    if deployment is not None:  # a recording replays the deployment that served it
        from kvstrata.bench.deployment import recorded_config
        from kvstrata.trace.parts import trace_measurements

        return recorded_config(deployment, overrides, trace_measurements(Path(args.trace)))
    return default_config(overrides)


def _recorded_deployment(args: argparse.Namespace) -> Any:
    """The deployment in a recorded trace's header (None for other traces and pipes)."""
    if not getattr(args, "trace", None) or args.trace == "-":
        return None
    from kvstrata.trace.parts import trace_header

    header = trace_header(Path(args.trace))
    return header.get("deployment") if header is not None else None


def _load_trace(args: argparse.Namespace, config: Any, progress: Progress) -> Any:
    """The built-in workload (in memory), or a reader that streams ``--trace`` through the analysis."""
    if args.trace is None:
        from kvstrata.bench.workloads import generate

        return generate(args.workload, args.seed, block_size=args.block_size or config.block_size, scale=args.scale)
    from kvstrata.trace.reader import TraceReader

    return TraceReader(args.trace, args.format, block_size=args.block_size, default_block_size=config.block_size,
                       skip_bad_lines=args.skip_bad_lines,
                       max_distinct_blocks=_max_distinct(args, config.model.num_groups),
                       progress=progress.reading("reading", _file_size(args.trace)))


def _max_distinct(args: argparse.Namespace, groups: int = 1) -> "DistinctLimit":
    """``--max-distinct-blocks``: the given number, none (0), or (by default) what the memory
    available now holds of the trace's format with ``groups`` KV-cache groups, decided once
    the format is known."""
    from kvstrata.bench.budget import default_max_distinct_blocks

    n = args.max_distinct_blocks
    if n is None:
        return lambda fmt, block_size: default_max_distinct_blocks(fmt, block_size, groups)
    return n or None


def _file_size(path: str) -> int | None:
    """Bytes of a regular file; None for a pipe, a device or what cannot be read (the loader reports it)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


PLOT_FORMATS = ("png", "svg", "pdf", "jpg", "jpeg", "webp", "tif", "tiff", "eps", "ps")  # what matplotlib writes


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse an output path that cannot be written before any work (a replay of a large
    trace must not end with its report lost): its directory must exist, and it must not
    be a directory itself."""
    from kvstrata.errors import ConfigError

    plot = getattr(args, "plot", None)
    if plot:
        suffix = Path(plot).suffix.lower().lstrip(".")
        if suffix not in PLOT_FORMATS:
            raise ConfigError(f"--plot: {plot}: unsupported format {suffix or '(none)'!r} "
                              f"(expected one of {', '.join(PLOT_FORMATS)})")
    for flag in ("json", "plot"):
        path = getattr(args, flag, None)
        if not path or path == "-":
            continue
        where = Path(path)
        parent = where.parent if str(where.parent) else Path(".")
        if where.is_dir():
            raise ConfigError(f"--{flag}: {path} is a directory; give a file name")
        if not parent.is_dir():
            raise ConfigError(f"--{flag}: {path}: the directory {parent} does not exist")
        if not os.access(parent, os.W_OK):
            raise ConfigError(f"--{flag}: {path}: the directory {parent} is not writable")


def cmd_bench(args: argparse.Namespace) -> int:
    from kvstrata.bench.analysis import run_bench
    from kvstrata.bench.replay import ReplayOptions
    from kvstrata.bench.report import build_report, render_text

    t0 = time.perf_counter()
    progress = Progress(enabled=not args.quiet and (args.progress or sys.stderr.isatty()))
    config = _load_config(args)
    admission = None if args.admission in (None, "both") else args.admission
    options = ReplayOptions(decode_s_per_token=args.decode_ms_per_token / 1000.0, payload=args.payload,
                            payload_block_bytes=args.payload_block_bytes, admission=admission,
                            explain=args.explain, max_memory=args.max_memory)
    if args.compare or args.replicas is not None:
        from kvstrata.cli.bench_modes import bench_compare, bench_replicas, refuse

        mode = bench_compare if args.compare else bench_replicas
        refuse("--compare" if args.compare else "--replicas",
               ("--replicas", args.compare and args.replicas is not None),
               ("--admission both", args.admission == "both"), ("--payload", args.payload),
               ("--explain", args.explain and args.compare), ("--plot", args.plot and not args.compare))
        return mode(args, _load_trace(args, config, progress), config, options, progress)
    trace = _load_trace(args, config, progress)
    t_load = time.perf_counter() - t0
    in_memory = args.trace is None  # a file is read (with its own progress) as the analysis goes
    try:
        res = run_bench(trace, config, options,
                        progress=progress.phase("replay", trace.num_requests) if in_memory else None,
                        compare_admissions=args.admission == "both")
    finally:
        progress.done()
    if res.trace.skipped_lines and not args.quiet:
        print(f"kvstrata: skipped {plural(res.trace.skipped_lines, 'bad line')} (first: {res.trace.first_skipped})",
              file=sys.stderr)
    res.timings_s["load"] = res.timings_s.get("load", 0.0) + t_load
    t_report = time.perf_counter()
    report = build_report(res)
    report["timings_s"]["report"] = round(time.perf_counter() - t_report, 3)
    if args.plot:
        from kvstrata.bench.plot import plot_report

        t_plot = time.perf_counter()
        draw_plot(plot_report, res, report, args.plot)
        report["timings_s"]["plot"] = round(time.perf_counter() - t_plot, 3)
    report["timings_s"]["total"] = round(time.perf_counter() - t0, 3)
    if args.json:
        write_json(args.json, report)
    if not args.quiet and args.json != "-":
        sys.stdout.write(render_text(report))
    return 0


# ------------------------------------------------------------------- plan

def cmd_plan(args: argparse.Namespace) -> int:
    from kvstrata.bench.plan import kv_pool_bytes, make_plan, render_plan, shape_from_args, shape_from_hf_config
    from kvstrata.errors import ConfigError

    if args.model_config:
        shape = shape_from_hf_config(args.model_config)
        if args.dtype:
            shape = dataclasses.replace(shape, dtype=args.dtype)
    else:
        missing = [f for f in ("layers", "kv_heads", "head_dim") if getattr(args, f) is None]
        if missing:
            raise ConfigError(f"--{missing[0].replace('_', '-')}: required without --model-config")
        shape = shape_from_args(args.layers, args.kv_heads, args.head_dim, args.dtype or "fp16")
    pool = kv_pool_bytes(kv_pool_gib=args.kv_pool_gib, gpu_mem_gib=args.gpu_mem_gib,
                         weights_gib=args.weights_gib, util=args.util)
    plan = make_plan(shape, pool, args.max_model_len, args.block_size, args.max_num_batched_tokens)
    if args.json:
        write_json(args.json, plan.to_dict())
    if not args.quiet and args.json != "-":
        sys.stdout.write(render_plan(plan))
    return 0


# ---------------------------------------------------------------- inspect

def cmd_inspect(args: argparse.Namespace) -> int:
    from kvstrata.bench.mrc import build_mrc
    from kvstrata.trace.reader import TraceReader

    reader = TraceReader(args.trace, args.format, block_size=args.block_size, skip_bad_lines=args.skip_bad_lines,
                         max_distinct_blocks=_max_distinct(args))
    sp = build_mrc(reader)
    trace = reader.info
    info = {"trace": trace.name, "format": trace.format, "block_tokens": trace.block_size,
            "requests": trace.num_requests, "block_accesses": trace.num_accesses,
            "distinct_blocks": trace.num_distinct_blocks, "duration_s": round(trace.duration_s, 3),
            "ideal_hit_rate": round(sp.mrc.ideal_hit_rate, 6),
            "saturation_tokens": sp.mrc.saturation_blocks * trace.block_size,
            "reuse_gap_s": sp.reuse_gaps.summary(), "skipped_lines": trace.skipped_lines}
    if args.json:
        write_json(args.json, info)
    else:
        sys.stdout.write(_render_inspect(info))
    return 0


def _render_inspect(info: dict[str, Any]) -> str:
    """``kvstrata inspect`` as a reader wants it: named rows, units, and what each figure means."""
    from kvstrata.system.values import format_seconds as sec

    gap = info["reuse_gap_s"]
    gaps = (f"P50 {sec(gap['p50'])} s, P90 {sec(gap['p90'])} s, P99 {sec(gap['p99'])} s over "
            f"{plural(gap['count'], 'reuse')}" if gap.get("count") else "none (no block is used twice)")
    rows = [
        ("requests", f"{info['requests']:,} over {sec(info['duration_s'])} s of trace time"),
        ("block accesses", f"{info['block_accesses']:,} ({info['block_tokens']}-token blocks)"),
        ("distinct blocks", f"{info['distinct_blocks']:,}"),
        ("ideal hit rate", f"{info['ideal_hit_rate']:.1%} (an unbounded cache: accesses to blocks seen "
                           "before / all accesses)"),
        ("cache for it", f"{info['saturation_tokens']:,} tokens (the smallest LRU cache that reaches the "
                         "ideal hit rate)"),
        ("reuse gap", f"{gaps}: the trace time between two uses of a block"),
    ]
    if info["skipped_lines"]:
        rows.append(("skipped", plural(info["skipped_lines"], "bad line")))
    width = max(len(k) for k, _ in rows)
    head = f"kvstrata inspect: {info['trace']} ({info['format']})\n"
    return head + "".join(f"  {k:<{width}}  {v}\n" for k, v in rows)


# ----------------------------------------------------------------- ssd

def _bench_args(p: argparse.ArgumentParser) -> None:
    from kvstrata.bench.workloads import DEFAULT_WORKLOAD, WORKLOADS

    src = p.add_argument_group("input")
    src.add_argument("--trace", metavar="PATH", help="JSONL request trace (default: a built-in workload)")
    src.add_argument("--format", default="auto", help="auto | mooncake | qwen | kvstrata (default: auto)")
    src.add_argument("--workload", choices=WORKLOADS, default=DEFAULT_WORKLOAD,
                     help=f"built-in workload when no --trace is given (default: {DEFAULT_WORKLOAD})")
    src.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    src.add_argument("--scale", type=finite(0, False, MAX_SCALE), default=1.0,
                     help=f"workload size multiplier (default: 1, at most {MAX_SCALE:g})")
    src.add_argument("--block-size", type=positive_int, default=None, metavar="TOKENS",
                     help="tokens per trace block (default: 512 mooncake, 16 qwen, the config's otherwise)")
    src.add_argument("--max-distinct-blocks", type=count, default=None, metavar="N", help=MAX_DISTINCT_HELP)
    bad = src.add_mutually_exclusive_group()
    bad.add_argument("--strict", dest="skip_bad_lines", action="store_false",
                     help="stop at the first bad line (default)")
    bad.add_argument("--skip-bad-lines", dest="skip_bad_lines", action="store_true",
                     help="skip malformed lines and report how many")
    p.set_defaults(skip_bad_lines=False)
    cfg = p.add_argument_group("cache")
    cfg.add_argument("--config", metavar="PATH",
                     help="kvstrata YAML config (default: an 8B fp16 model on a 48 GB card, 22 GiB GPU pool, "
                          "64 GiB DRAM, 1 TiB SSD)")
    cfg.add_argument("--set", action="append", metavar="KEY=VALUE", help="override, e.g. cpu.capacity=16GiB")
    cfg.add_argument("--admission", choices=(*ADMISSIONS, "both"), default=None,
                     help="spill.admission to replay (default: the config's); 'both' compares them in one report")
    cfg.add_argument("--decode-ms-per-token", type=finite(0, True), default=20.0,
                     help="a request holds its GPU blocks for output_length x this (default: 20)")
    cfg.add_argument("--payload", action="store_true", help="move real bytes through the CPU slab and the SSD tier")
    cfg.add_argument("--compare", action="store_true",
                     help="replay every eviction (cpu/ssd.eviction) x SSD admission at three capacities, side by side")
    cfg.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                     help="replay on N replicas sharing a remote tier of remote.capacity, with and without it")
    cfg.add_argument("--routing", choices=("round_robin", "prefix", "both"), default="both",
                     help="how --replicas routes requests: round robin, to the replica holding the longest "
                          "prefix, or both side by side (default: both)")
    cfg.add_argument("--payload-block-bytes", type=block_bytes, default="16KiB", metavar="SIZE",
                     help="bytes per block with --payload (default: 16KiB)")
    cfg.add_argument("--max-memory", type=block_bytes, default=None, metavar="SIZE",
                     help="refuse a deployment whose replay would need more memory than this, before building "
                          "it (default: half the machine's memory)")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write the report as JSON ('-' for stdout)")
    out.add_argument("--plot", metavar="PATH.png", help="write the miss-ratio curve and lifecycle plot")
    out.add_argument("--explain", action="store_true",
                     help="say why each request's first missed block missed (never seen, evicted from which tier "
                          "and how long before, rejected); all of them under 'misses' in --json")
    out.add_argument("--quiet", action="store_true", help="print only errors")
    out.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a tty")


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="a Hugging Face Llama-family checkpoint directory")
    p.add_argument("--prompt-file", required=True, metavar="PATH",
                   help="JSONL: a list of token ids, {\"prompt_token_ids\": [...]} or {\"prompt\": \"text\"} per line")
    p.add_argument("--config", metavar="PATH", help="kvstrata YAML config (gpu.* sizes the engine's pool)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override, e.g. cpu.capacity=1GiB")
    p.add_argument("--n", type=positive_int, default=1, help="samples per prompt, sharing its blocks (default: 1)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="N", help="(default: 32)")
    p.add_argument("--kv-cache-dtype", default=None, metavar="DTYPE",
                   help="auto | fp8 | fp8_e4m3 | fp8_e5m2 (default: model.kv_dtype, else auto)")
    p.add_argument("--k-scale", type=finite(0, False), default=1.0, help="FP8 K scale (default: 1)")
    p.add_argument("--v-scale", type=finite(0, False), default=1.0, help="FP8 V scale (default: 1)")
    p.add_argument("--json", metavar="PATH", help="write the outputs as JSON ('-' for stdout)")
    p.add_argument("--quiet", action="store_true", help="print only errors")


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-config", metavar="config.json", help="Hugging Face model config")
    p.add_argument("--layers", type=positive_int)
    p.add_argument("--kv-heads", type=positive_int)
    p.add_argument("--head-dim", type=positive_int)
    p.add_argument("--dtype", choices=("fp16", "bf16", "fp8", "fp32"), help="KV cache dtype (default: the model's)")
    p.add_argument("--kv-pool-gib", type=finite(0, False), help="KV pool size")
    p.add_argument("--gpu-mem-gib", type=finite(0, False), help="GPU memory (with --weights-gib)")
    p.add_argument("--weights-gib", type=finite(0, True), help="memory taken by the weights")
    p.add_argument("--util", type=finite(0, False, 1), default=0.9, help="gpu_memory_utilization (default: 0.9)")
    p.add_argument("--max-model-len", type=positive_int, default=8192, help="tokens per request (default: 8192)")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per block (default: 16)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=8192,
                   help="vLLM's token budget per step: what a sliding window holds beyond the window (default: 8192)")
    p.add_argument("--json", metavar="PATH", help="write the plan as JSON ('-' for stdout)")
    p.add_argument("--quiet", action="store_true", help="print only errors")


def build_parser() -> argparse.ArgumentParser:
    from kvstrata import __version__
    from kvstrata.tiers.kinds import kinds

    parser = argparse.ArgumentParser(prog="kvstrata", description="Multi-tier KV cache: size it from your traffic.")
    parser.add_argument("--version", action="version", version=f"kvstrata {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="replay traffic through the tiered cache; hit rates, curves, sizing")
    _bench_args(bench)
    bench.set_defaults(func=cmd_bench)
    plan = sub.add_parser("plan", help="KV memory planning: bytes per token, pool tokens, concurrency")
    _plan_args(plan)
    plan.set_defaults(func=cmd_plan)
    for kind in kinds().values():  # a tier kind's operator commands: kvstrata ssd, kvstrata remote
        if kind.commands is not None:
            kind.commands(sub)
    gen = sub.add_parser("generate", help="greedy generation with kvstrata.engine (a Llama-family checkpoint)")
    _generate_args(gen)
    gen.set_defaults(func=cmd_generate)
    insp = sub.add_parser("inspect", help="summarise a trace (no replay)")
    insp.add_argument("--trace", required=True, metavar="PATH")
    insp.add_argument("--format", default="auto")
    insp.add_argument("--block-size", type=positive_int, default=None, metavar="TOKENS")
    insp.add_argument("--skip-bad-lines", action="store_true")
    insp.add_argument("--max-distinct-blocks", type=count, default=None, metavar="N", help=MAX_DISTINCT_HELP)
    insp.add_argument("--json", metavar="PATH")
    insp.set_defaults(func=cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from kvstrata.bench.replay import ReplayError
    from kvstrata.trace.reader import TraceError
    from kvstrata.errors import ConfigError

    args = build_parser().parse_args(argv)
    try:
        _check_outputs(args)
        return int(args.func(args))
    except (TraceError, ConfigError, ReplayError) as e:
        print(f"kvstrata: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"kvstrata: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvstrata: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
