"""kvstrata's start-up under vLLM against the size of the SSD tier it reopens.

vLLM's real scheduler with ``KVStrataConnector`` and a real ``KVStrataWorker`` (the
harness of ``tests/vllm_sched.py``: everything of kvstrata's start-up, without the
model runner), started the way ``EngineCore`` starts them (the worker opens its
SSD tier, then the scheduler reads every key and seeds its policy), over:

* a tier of ``--records`` records (closed cleanly; ``compression: none``; the
  tiny test model's blocks of ``--block-size`` tokens), and
* an empty tier,

alternately, ``--repeats`` times each. For each start: seconds to build the worker
(its SSD tier open), seconds to build the scheduler (its policy seeded from the
worker's tier in this process: vLLM's single-process executor), and seconds until
the first request is served (on the full tier it loads a prompt stored before
the restart from disk: checked). Then the scheduler alone, as with worker
processes: it reads the keys beside them, in a child process. What the model,
the engine and the GPU add does not depend on the tier's size and is not
measured here.

    .venv/bin/python benchmarks/scale_startup.py [--records 1000000] [--dir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from vllm_sched import RealWorker, SchedulerHarness, block_nbytes  # noqa: E402
from vllm_util import build_tiny_llama, random_token_prompt  # noqa: E402

GPU_BLOCKS = 64


def _extra(ssd: Path, records: int, block_size: int) -> dict[str, Any]:
    from kvstrata.tiers.ssd import record_footprint

    capacity = int((records + 64) * record_footprint(48, block_nbytes(block_size)) * 1.05)
    return {"cpu.capacity": 8 * block_nbytes(block_size), "ssd.path": str(ssd), "ssd.capacity": capacity,
            "ssd.compression": "none"}


def _start(model: str, extra: dict[str, Any], block_size: int) -> tuple[SchedulerHarness, RealWorker, dict[str, float]]:
    """One start: the worker (its tier opened), then the scheduler (its policy seeded)."""
    holder: dict[str, RealWorker] = {}
    times: dict[str, float] = {}

    def workers_first(vllm_config: Any, kv_cache_config: Any) -> None:
        t0 = time.perf_counter()
        holder["w"] = RealWorker(vllm_config, extra, kv_cache_config)
        times["worker_s"] = time.perf_counter() - t0
        times["t_scheduler"] = time.perf_counter()

    t0 = time.perf_counter()
    h = SchedulerHarness(model, block_size=block_size, num_gpu_blocks=GPU_BLOCKS, kv_connector_extra_config=extra,
                         worker=lambda meta: holder["w"](meta), before_scheduler=workers_first)
    times["scheduler_s"] = time.perf_counter() - times.pop("t_scheduler")
    times["t0"] = t0
    return h, holder["w"], times


def _stop(h: SchedulerHarness, worker: RealWorker) -> None:
    worker.worker.shutdown()
    h.close()


def build(model: str, ssd: Path, records: int, block_size: int) -> list[int]:
    """A tier of ``records`` blocks under the model's namespace, closed cleanly: one prompt
    stored through the connector (returned), the rest written straight into the tier."""
    from kvstrata.tiers.ssd import SSDTier
    from kvstrata.tiers.ssd.kind import ssd_root
    from kvstrata.connectors.vllm.common import engine_ranks
    from kvstrata.connectors.vllm.common import load_config

    extra = _extra(ssd, records, block_size)
    prompt = random_token_prompt(2 * block_size + 1, seed=7)
    h, worker, _ = _start(model, extra, block_size)
    try:
        h.run_group([("stored", prompt)])
        sched = h.connector._scheduler
        rank = engine_ranks(h.vllm_config)[0]
        path, tier_id = rank.directory(ssd_root(load_config(extra))), rank.tier_id(sched.fingerprint)
        held = sched.policy.occupancy()["ssd"]
    finally:
        _stop(h, worker)
    nbytes = block_nbytes(block_size)
    block = np.random.default_rng(0).integers(0, 256, nbytes, np.uint8).tobytes()
    tier = SSDTier(path, capacity_bytes=int(extra["ssd.capacity"]), fingerprint=tier_id, compression="none",
                   block_nbytes=nbytes)
    try:
        for i in range(records - held):
            key = (i + 1).to_bytes(32, "big")
            while not tier.put(key, block):  # the queue is full: let the writer catch up
                tier.flush()
        assert tier.flush(), tier.stats()
    finally:
        tier.close()
    return prompt


def measure(model: str, ssd: Path, records: int, block_size: int, prompt: list[int] | None) -> dict[str, float]:
    """One start over the tier at ``ssd``, up to the first request served."""
    h, worker, times = _start(model, _extra(ssd, records, block_size), block_size)
    try:
        held = h.connector._scheduler.policy.occupancy()["ssd"]
        (res,) = h.run_group([("first", prompt or random_token_prompt(2 * block_size + 1, seed=8))])
        times["first_request_s"] = time.perf_counter() - times.pop("t0")
        if prompt is not None:
            assert held >= records, f"the scheduler holds {held} of {records} blocks"
            assert res.external_hit_tokens == {"disk": 2 * block_size}, res.external_hit_tokens
            assert worker.load_errors == 0
    finally:
        _stop(h, worker)
    return times


def measure_scheduler_alone(model: str, ssd: Path, records: int, block_size: int) -> float:
    """Seconds to build the scheduler with no worker in this process (it reads the keys
    from beside the workers, as under the multiprocess executor)."""
    t0 = time.perf_counter()
    h = SchedulerHarness(model, block_size=block_size, num_gpu_blocks=GPU_BLOCKS,
                         kv_connector_extra_config=_extra(ssd, records, block_size))
    seconds = time.perf_counter() - t0
    held = h.connector._scheduler.policy.occupancy()["ssd"]
    h.close()
    assert held >= records or records == 0, f"the scheduler holds {held} of {records} blocks"
    return seconds


def run(records: int, block_size: int, repeats: int, where: Path) -> dict[str, Any]:
    model = str(build_tiny_llama(where / "model"))
    full = where / "ssd-full"
    t0 = time.perf_counter()
    prompt = build(model, full, records, block_size)
    built_s = time.perf_counter() - t0
    rows: dict[str, list[dict[str, float]]] = {"full": [], "empty": []}
    for _ in range(repeats):
        rows["full"].append(measure(model, full, records, block_size, prompt))
        rows["full"][-1]["scheduler_alone_s"] = measure_scheduler_alone(model, full, records, block_size)
        empty = where / "ssd-empty"
        shutil.rmtree(empty, ignore_errors=True)
        rows["empty"].append(measure(model, empty, records, block_size, None))
        rows["empty"][-1]["scheduler_alone_s"] = measure_scheduler_alone(model, empty, 0, block_size)
    med = {kind: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for kind, runs in rows.items()}
    return {"records": records, "block_bytes": block_nbytes(block_size), "build_s": built_s, "median": med}


def markdown(out: dict[str, Any]) -> str:
    med = out["median"]
    lines = [f"{out['records']:,} records of {out['block_bytes']:,} bytes (built in {out['build_s']:.0f} s); "
             "medians:", "",
             "| SSD tier | worker (tier open) | scheduler beside it (keys read, policy seeded) "
             "| to first request served | scheduler in its own process |",
             "|---|---:|---:|---:|---:|"]
    for kind in ("empty", "full"):
        m = med[kind]
        lines.append(f"| {kind} | {m['worker_s']:.2f} s | {m['scheduler_s']:.2f} s | {m['first_request_s']:.2f} s "
                     f"| {m['scheduler_alone_s']:.2f} s |")
    extra = med["full"]["first_request_s"] - med["empty"]["first_request_s"]
    lines += ["", f"Start-up added by the full tier: {extra:.2f} s."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--block-size", type=int, default=2, help="tokens per block (the tiny model: 4 KiB at 2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", help="where to build the model and the tiers (default: a temporary directory)")
    args = ap.parse_args()
    where = Path(tempfile.mkdtemp(prefix="kvstrata-startup-", dir=args.dir))
    try:
        print(markdown(run(args.records, args.block_size, args.repeats, where)))
    finally:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
