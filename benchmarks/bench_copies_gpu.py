"""The CPU tier's data path on one GPU, as ratios against references measured
in the same run:

  (a) baseline: one contiguous ``copy_(non_blocking=True)`` between a device
      tensor and pinned host memory (cudaMemcpyAsync), D2H and H2D, 64 MiB and
      1 GiB, and the same at 1 GiB into a HostSlab (page-locked in chunks);
  (b) store = ``gather_blocks(caches, ids, slab, out_rows=slots)`` from 32
      per-layer caches straight into slots of a HostSlab, load =
      ``scatter_blocks(slab, caches, ids, staging_rows=slots)``; pages of 16 and
      64 KiB per layer (block = 32 pages), 16/64/256/1024 blocks per job, as a
      fraction of (a) at 1 GiB in the same direction (target >= 0.8 from 64
      blocks up), jobs issued back to back; then a sweep of max_thread_blocks;
  (c) interference: a fixed loop of bf16 matmuls (a step of 10-30 ms) alone,
      then with stores running back to back on a second stream, p50/p99 step
      inflation (target < 5%): compute at torch's default priority (vLLM's
      forward pass) and at the highest, copies at the lowest, with the default
      and other thread-block caps;
  (d) every store and load is checked bit-exact (exit status 1 otherwise).

Writes bench_copies.json and bench_copies.md to $OUT (or --out) and prints
the tables.

    python benchmarks/bench_copies_gpu.py              # needs a CUDA device
    python benchmarks/bench_copies_gpu.py --dry-run    # tiny sizes on the CPU: the plumbing only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstrata.kernels import gather_blocks, scatter_blocks
from kvstrata.tiers.host import PIN_CHUNK_BYTES, HostSlab

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
COPY_TARGET, COPY_TARGET_FROM_BLOCKS, INFLATION_TARGET = 0.80, 64, 0.05
UNCAPPED = 2**31 - 1


@dataclass(frozen=True)
class Sizes:
    """Everything that scales: the real run, or a tiny one for --dry-run."""

    baseline: tuple[int, ...] = (64 * MiB, GiB)
    layers: int = 32
    pages: tuple[int, ...] = (16 * KiB, 64 * KiB)
    jobs: tuple[int, ...] = (16, 64, 256, 1024)
    pool_blocks: int = 1280
    sample_bytes: int = 256 * MiB  # bytes moved per timing sample (jobs back to back)
    samples: int = 5
    sweep_page: int = 64 * KiB
    sweep_blocks: int = 256
    sweep_caps: tuple[int | None, ...] = (1, 4, 8, 16, None, 64, 132, UNCAPPED)
    matmul: tuple[int, int] = (4096, 8192)  # M, K = N
    step_seconds: float = 0.020
    steps: int = 100
    store_blocks: int = 256  # per store job during (c), 64 KiB pages


DRY = Sizes(baseline=(64 * KiB, MiB), layers=4, pages=(256, 1024), jobs=(2, 4, 8, 16), pool_blocks=24,
            sample_bytes=MiB, samples=2, sweep_page=1024, sweep_blocks=8, sweep_caps=(1, None, UNCAPPED),
            matmul=(64, 64), step_seconds=0.002, steps=8, store_blocks=8)


class Clock:
    """Seconds for ``k`` back-to-back calls: CUDA events on the current stream, or
    perf_counter on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def sample(self, fn: Callable[[], object], k: int = 1) -> float:
        if not self.cuda:
            start = time.perf_counter()
            for _ in range(k):
                fn()
            return time.perf_counter() - start
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(k):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def median(self, fn: Callable[[], object], samples: int, k: int = 1) -> float:
        self.sample(fn, 1)  # warm-up (first launch compiles the kernel)
        return statistics.median(self.sample(fn, k) for _ in range(samples))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


@dataclass
class Report:
    results: dict[str, Any] = field(default_factory=dict)
    checks: list[tuple[str, bool]] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    def check(self, name: str, ok: bool) -> None:
        self.checks.append((name, bool(ok)))
        if not ok:
            print(f"NOT BIT-EXACT: {name}", file=sys.stderr, flush=True)


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


# ---------------------------------------------------------------------- (a) baseline

def memcpy(clock: Clock, dst: torch.Tensor, src: torch.Tensor, samples: int) -> float:
    """GB/s of one ``dst.copy_(src, non_blocking=True)``."""
    return gbps(src.numel(), clock.median(lambda: dst.copy_(src, non_blocking=True), samples))


def baseline(clock: Clock, sizes: Sizes, device: torch.device, slab: HostSlab, rep: Report) -> dict[str, float]:
    rows = []
    for nbytes in sizes.baseline:
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=clock.cuda)
        samples = 20 if nbytes <= 64 * MiB else 5
        rows.append({"what": "pinned tensor (cudaHostAlloc)", "bytes": nbytes,
                     "d2h_GBps": memcpy(clock, host, dev, samples), "h2d_GBps": memcpy(clock, dev, host, samples)})
    nbytes = min(sizes.baseline[-1], slab.tensor.numel())
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dev = torch.empty_like(src)
    flat = slab.tensor.view(-1)[:nbytes]
    rows.append({"what": "HostSlab (registered in chunks)", "bytes": nbytes,
                 "d2h_GBps": memcpy(clock, flat, src, 5), "h2d_GBps": memcpy(clock, dev, flat, 5)})
    clock.sync()
    rep.check("baseline: a round trip through the slab", torch.equal(dev, src))
    rep.results["baseline"] = rows
    rep.lines += ["### (a) contiguous copy_(non_blocking=True), pinned host memory", "",
                  "| host memory | size | D2H GB/s | H2D GB/s |", "|---|---:|---:|---:|"]
    rep.lines += [f"| {r['what']} | {r['bytes'] / MiB:g} MiB | {r['d2h_GBps']:.1f} | {r['h2d_GBps']:.1f} |" for r in rows]
    largest = rows[len(sizes.baseline) - 1]  # the reference of (b)
    return {"d2h": largest["d2h_GBps"], "h2d": largest["h2d_GBps"]}


# ---------------------------------------------------------------------- (b) store / load

def make_caches(sizes: Sizes, page: int, device: torch.device) -> list[torch.Tensor]:
    """``layers`` per-layer bf16 caches [pool_blocks, 2 (K, V), page // 4]: ``page`` bytes per
    block and layer, random bits made on the device (compared as bytes: some are NaN as bf16)."""
    caches = []
    for _ in range(sizes.layers):
        raw = torch.randint(0, 256, (sizes.pool_blocks, page), dtype=torch.uint8, device=device)
        caches.append(raw.view(torch.bfloat16).view(sizes.pool_blocks, 2, page // 4))
    return caches


def page_rows(caches: list[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """The staging rows of blocks ``ids``: every layer's page, as bytes."""
    return torch.cat([c[ids].view(torch.uint8).reshape(len(ids), -1) for c in caches], dim=1)


def slab_rows(slab: HostSlab, row_bytes: int) -> torch.Tensor:
    n = slab.tensor.numel() // row_bytes
    return slab.tensor.view(-1)[: n * row_bytes].view(n, row_bytes)


@dataclass
class Job:
    """One store and one load of ``n`` blocks: src ids -> slots -> dst ids."""

    caches: list[torch.Tensor]
    dst: list[torch.Tensor]
    staging: torch.Tensor
    ids: torch.Tensor
    slots: torch.Tensor
    back: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.ids.numel() * self.staging.shape[1]

    def store(self, cap: int | None = None) -> None:
        gather_blocks(self.caches, self.ids, self.staging, out_rows=self.slots, max_thread_blocks=cap, check_indices=False)

    def load(self, cap: int | None = None) -> None:
        scatter_blocks(self.staging, self.dst, self.back, staging_rows=self.slots, max_thread_blocks=cap,
                       check_indices=False)

    def verify(self, rep: Report, name: str, clock: Clock) -> None:
        clock.sync()
        want = page_rows(self.caches, self.ids).cpu()
        rep.check(f"{name}: store", torch.equal(self.staging[self.slots.cpu()], want))
        rep.check(f"{name}: load", all(torch.equal(d[self.back].view(torch.uint8), c[self.ids].view(torch.uint8))
                                        for c, d in zip(self.caches, self.dst)))


def make_job(caches: list[torch.Tensor], dst: list[torch.Tensor], staging: torch.Tensor, n: int,
             gen: torch.Generator) -> Job:
    device = caches[0].device
    pick = lambda m: torch.randperm(m, generator=gen)[:n].to(device)  # noqa: E731
    return Job(caches, dst, staging, pick(caches[0].shape[0]), pick(staging.shape[0]), pick(caches[0].shape[0]))


def timed_job(clock: Clock, sizes: Sizes, fn: Callable[[], None], nbytes: int) -> tuple[float, float]:
    """(GB/s of jobs issued back to back, host microseconds to issue one)."""
    k = max(1, min(64, sizes.sample_bytes // nbytes))
    fn()
    clock.sync()
    start = time.perf_counter()
    fn()
    host_us = (time.perf_counter() - start) * 1e6
    return gbps(k * nbytes, clock.median(fn, sizes.samples, k)), host_us


def store_load(clock: Clock, sizes: Sizes, device: torch.device, slab: HostSlab, ref: dict[str, float],
               rep: Report, gen: torch.Generator) -> None:
    rows, swept = [], []
    for page in sizes.pages:
        caches, dst = make_caches(sizes, page, device), make_caches(sizes, page, device)
        staging = slab_rows(slab, sizes.layers * page)
        for n in sizes.jobs:
            job = make_job(caches, dst, staging, n, gen)
            store, store_us = timed_job(clock, sizes, job.store, job.nbytes)
            load, load_us = timed_job(clock, sizes, job.load, job.nbytes)
            job.verify(rep, f"page {page} B, {n} blocks", clock)
            rows.append({"page_bytes": page, "blocks": n, "job_bytes": job.nbytes, "store_GBps": store,
                         "store_ratio": store / ref["d2h"], "load_GBps": load, "load_ratio": load / ref["h2d"],
                         "store_host_us": store_us, "load_host_us": load_us,
                         "target": COPY_TARGET if n >= COPY_TARGET_FROM_BLOCKS else None})
        if page == sizes.sweep_page:
            swept = sweep(clock, sizes, make_job(caches, dst, staging, sizes.sweep_blocks, gen), ref, rep)
        del caches, dst
    rep.results["store_load"] = rows
    rep.results["thread_block_sweep"] = {"page_bytes": sizes.sweep_page, "blocks": sizes.sweep_blocks, "rows": swept}
    rep.lines += ["", f"### (b) store / load, {sizes.layers} layers, through HostSlab slots "
                      f"(ratio = / (a) at {sizes.baseline[-1] / MiB:.0f} MiB; target >= {COPY_TARGET} from "
                      f"{COPY_TARGET_FROM_BLOCKS} blocks)", "",
                  "| page | blocks/job | MiB/job | store GB/s | ratio | load GB/s | ratio | host us/job (st, ld) | |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        ok = "" if r["target"] is None else ("ok" if min(r["store_ratio"], r["load_ratio"]) >= r["target"] else "BELOW")
        rep.lines.append(f"| {r['page_bytes'] / KiB:g} KiB | {r['blocks']} | {r['job_bytes'] / MiB:.1f} | "
                         f"{r['store_GBps']:.1f} | {r['store_ratio']:.2f} | {r['load_GBps']:.1f} | "
                         f"{r['load_ratio']:.2f} | {r['store_host_us']:.0f}, {r['load_host_us']:.0f} | {ok} |")
    rep.lines += ["", f"### (b') max_thread_blocks, {sizes.sweep_blocks} blocks of {sizes.layers} x "
                      f"{sizes.sweep_page / KiB:g} KiB pages (default: {_default_cap()} for host staging)", "",
                  "| max_thread_blocks | store GB/s | ratio | load GB/s | ratio |", "|---|---:|---:|---:|---:|"]
    rep.lines += [f"| {r['max_thread_blocks']} | {r['store_GBps']:.1f} | {r['store_ratio']:.2f} | "
                  f"{r['load_GBps']:.1f} | {r['load_ratio']:.2f} |" for r in swept]


def cap_name(cap: int | None) -> str:
    return "default" if cap is None else ("uncapped" if cap == UNCAPPED else str(cap))


def sweep(clock: Clock, sizes: Sizes, job: Job, ref: dict[str, float], rep: Report) -> list[dict[str, Any]]:
    rows = []
    for cap in sizes.sweep_caps:
        store, _ = timed_job(clock, sizes, lambda: job.store(cap), job.nbytes)
        load, _ = timed_job(clock, sizes, lambda: job.load(cap), job.nbytes)
        job.verify(rep, f"max_thread_blocks {cap_name(cap)}", clock)
        rows.append({"max_thread_blocks": cap_name(cap), "store_GBps": store, "store_ratio": store / ref["d2h"],
                     "load_GBps": load, "load_ratio": load / ref["h2d"]})
    return rows


def _default_cap() -> int:
    from kvstrata.kernels.cuda_block_ops import HOST_STAGING_THREAD_BLOCKS

    return HOST_STAGING_THREAD_BLOCKS


# ---------------------------------------------------------------------- (c) interference

def on_stream(stream: Any) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def priority_range(cuda: bool) -> tuple[int, int]:
    """(lowest, highest) stream priority torch offers; a lower number is a higher priority."""
    if not cuda:
        return 0, 0
    for get in (lambda: torch.cuda.Stream.priority_range(), lambda: torch.cuda.Stream().priority_range()):
        try:
            low, high = get()
            return int(low), int(high)
        except Exception:
            continue
    return 0, -1


class Matmuls:
    """The stand-in forward pass: ``count`` bf16 matmuls [M, K] x [K, K]."""

    def __init__(self, sizes: Sizes, device: torch.device, clock: Clock) -> None:
        m, k = sizes.matmul
        dtype = torch.bfloat16 if clock.cuda else torch.float32
        self.a = torch.randn(m, k, device=device).to(dtype)
        self.w = [torch.randn(k, k, device=device).to(dtype) / math.sqrt(k) for _ in range(2)]
        self.out = torch.empty(m, k, device=device, dtype=dtype)
        one = clock.median(lambda: torch.matmul(self.a, self.w[0], out=self.out), 10)
        self.count = max(4, min(400, round(sizes.step_seconds / one)))
        self.flops = 2 * m * k * k * self.count

    def step(self) -> None:
        for i in range(self.count):
            torch.matmul(self.a, self.w[i % 2], out=self.out)


def step_times(mm: Matmuls, stream: Any, steps: int, cuda: bool) -> list[float]:
    """Seconds of each of ``steps`` steps on ``stream``, at most two steps queued ahead."""
    if not cuda:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            mm.step()
            times.append(time.perf_counter() - start)
        return times
    events = []
    with on_stream(stream):
        for i in range(steps + 3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            mm.step()
            end.record()
            events.append((start, end))
            if len(events) > 2:
                events[-3][1].synchronize()
    events[-1][1].synchronize()
    return [s.elapsed_time(e) / 1e3 for s, e in events[3:]]  # the first three warm up


class StoreLoop:
    """Stores issued back to back on ``stream`` from a thread of their own (two in flight)."""

    def __init__(self, job: Job, cap: int | None, stream: Any, cuda: bool) -> None:
        self.job, self.cap, self.stream, self.cuda = job, cap, stream, cuda
        self.stop, self.done = threading.Event(), 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="stores", daemon=True)

    def _run(self) -> None:
        try:
            pending: deque[Any] = deque()
            with on_stream(self.stream):
                while not self.stop.is_set():
                    self.job.store(self.cap)
                    if self.cuda:
                        event = torch.cuda.Event()
                        event.record()
                        pending.append(event)
                        if len(pending) > 2:
                            pending.popleft().synchronize()
                    self.done += 1
                for event in pending:
                    event.synchronize()
        except BaseException as exc:  # reported by __exit__
            self.error = exc

    def __enter__(self) -> "StoreLoop":
        self.started = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.seconds = time.perf_counter() - self.started
        if self.error is not None:
            raise RuntimeError("the store loop failed") from self.error


def percentiles(times: list[float]) -> tuple[float, float]:
    return float(np.percentile(times, 50)), float(np.percentile(times, 99))


def _step_row(name: str, prio: int, copy_prio: int | None, times: list[float], alone: tuple[float, float],
              moved: float | None) -> dict[str, Any]:
    p50, p99 = percentiles(times)
    return {"scenario": name, "compute_priority": prio, "copy_priority": copy_prio, "p50_ms": p50 * 1e3,
            "p99_ms": p99 * 1e3, "p50_inflation": p50 / alone[0] - 1, "p99_inflation": p99 / alone[1] - 1,
            "stores_GBps": moved}


def interference(clock: Clock, sizes: Sizes, device: torch.device, slab: HostSlab, rep: Report,
                 gen: torch.Generator) -> None:
    low, high = priority_range(clock.cuda)
    stream = (lambda p: torch.cuda.Stream(device=device, priority=p)) if clock.cuda else (lambda p: None)
    page = sizes.pages[-1]
    caches, dst = make_caches(sizes, page, device), make_caches(sizes, page, device)
    job = make_job(caches, dst, slab_rows(slab, sizes.layers * page), sizes.store_blocks, gen)
    job.store()  # compiled before anything is timed
    mm = Matmuls(sizes, device, clock)
    rows, alone = [], {}
    for prio in dict.fromkeys((0, high)):  # torch's default priority (vLLM's forward pass), then the highest
        where = "default" if prio == 0 else "highest"
        times = step_times(mm, stream(prio), sizes.steps, clock.cuda)
        alone[prio] = percentiles(times)
        rows.append(_step_row(f"alone, compute at {where} priority", prio, None, times, alone[prio], None))
        for cap in (None, UNCAPPED, 8):
            with StoreLoop(job, cap, stream(low), clock.cuda) as loop:
                times = step_times(mm, stream(prio), sizes.steps, clock.cuda)
            rows.append(_step_row(f"stores (max_thread_blocks {cap_name(cap)}), compute at {where} priority", prio,
                                  low, times, alone[prio], gbps(loop.done * job.nbytes, loop.seconds)))
    job.load()
    clock.sync()
    job.verify(rep, "after the interference runs", clock)
    rep.results["interference"] = {"matmuls_per_step": mm.count, "matmul": list(sizes.matmul),
                                   "tflops_alone": mm.flops / alone[0][0] / 1e12, "priority_range": [low, high],
                                   "store_job_bytes": job.nbytes, "rows": rows, "target": INFLATION_TARGET}
    rep.lines += ["", f"### (c) interference: {mm.count} matmuls [{sizes.matmul[0]} x {sizes.matmul[1]}] x "
                      f"[{sizes.matmul[1]} x {sizes.matmul[1]}] per step; stores of {job.nbytes / MiB:.0f} MiB back "
                      f"to back at priority {low} (torch's range: {low} lowest .. {high} highest); "
                      f"target < {INFLATION_TARGET:.0%}", "",
                  "| scenario | p50 ms | p99 ms | p50 inflation | p99 inflation | stores GB/s | |",
                  "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        ok = "" if r["stores_GBps"] is None else (
            "ok" if max(r["p50_inflation"], r["p99_inflation"]) < INFLATION_TARGET else "ABOVE")
        moved = "" if r["stores_GBps"] is None else f"{r['stores_GBps']:.1f}"
        rep.lines.append(f"| {r['scenario']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['p50_inflation']:+.1%} | "
                         f"{r['p99_inflation']:+.1%} | {moved} | {ok} |")


# ---------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (no GPU needed)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="directory for the JSON and markdown")
    args = parser.parse_args(argv)
    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        print("no CUDA device (use --dry-run to check the plumbing on the CPU)", file=sys.stderr)
        return 2
    sizes, device = (Sizes(), torch.device("cuda")) if cuda else (DRY, torch.device("cpu"))
    if not cuda:
        torch.set_num_threads(1)  # small CPU copies crawl when torch's threads contend
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    clock, rep = Clock(cuda), Report()
    started = time.perf_counter()
    slab_bytes = sizes.pool_blocks * sizes.layers * max(sizes.pages)
    t0 = time.perf_counter()
    slab = HostSlab(sizes.pool_blocks, sizes.layers * max(sizes.pages), pin_memory=cuda or None)
    rep.results["slab"] = {"bytes": slab_bytes, "pinned": slab.pinned, "chunk_bytes": PIN_CHUNK_BYTES,
                           "seconds_to_allocate": time.perf_counter() - t0}
    if cuda and not slab.pinned:
        print("the HostSlab could not be page-locked (see the warning above)", file=sys.stderr)
        return 1
    name = torch.cuda.get_device_name() if cuda else "cpu (dry run)"
    rep.results.update({"device": name, "torch": torch.__version__, "dry_run": not cuda})
    rep.lines += [f"## Copies: {name}, torch {torch.__version__}; HostSlab {slab_bytes / GiB:.2f} GiB "
                  f"{'page-locked' if slab.pinned else 'pageable'} in {rep.results['slab']['seconds_to_allocate']:.2f} s", ""]
    def save(state: str) -> None:  # after every section: a run cut short keeps what it measured
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "bench_copies.json").write_text(json.dumps({**rep.results, "state": state}, indent=2))
            (out / "bench_copies.md").write_text("\n".join(rep.lines) + "\n")

    save("started")
    ref = baseline(clock, sizes, device, slab, rep)
    save("baseline")
    store_load(clock, sizes, device, slab, ref, rep, gen)
    save("store_load")
    interference(clock, sizes, device, slab, rep, gen)
    failed = [n for n, ok in rep.checks if not ok]
    rep.results["bit_exact"] = {"checks": len(rep.checks), "failed": failed}
    rep.results["seconds"] = time.perf_counter() - started
    rep.lines += ["", f"### (d) bit-exact: {len(rep.checks) - len(failed)} of {len(rep.checks)} checks passed"
                      + (f"; FAILED: {', '.join(failed)}" if failed else ""),
                  "", f"({rep.results['seconds']:.0f} s)"]
    text = "\n".join(rep.lines) + "\n"
    print(text)
    save("done")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
