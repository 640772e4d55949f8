"""What the request recorder costs vLLM's scheduler, working and failing.

vLLM's real v1 ``Scheduler`` with kvstrata's scheduler half (no model runs: the
harness of the tests, ``tests/vllm_sched.py``, whose worker completes every plan
in its step) serves multi-turn chats one request at a time; the figure is the
scheduler's wall time per request, as a ratio to the same run without the
recorder. Modes, each in its own process, alternated over ``--repeat`` rounds:

* ``off``: no ``trace.path``;
* ``on``: recording every request;
* ``unwritable``: ``trace.path`` under a regular file (recording stops at start-up);
* ``disk full``: the process's file size limit (``RLIMIT_FSIZE``, SIGXFSZ ignored)
  makes the kernel refuse the recorder's write once the trace passes 64 KiB, as a
  full disk would (recording stops mid-run).

The hits the plugin counted must be the same in every mode.

    .venv/bin/python benchmarks/bench_recorder.py [--requests 400] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODES = ("off", "on", "unwritable", "disk full")


def child(mode: str, requests: int, tmp: Path) -> dict[str, Any]:
    import random
    import resource
    import signal
    import time

    sys.path.insert(0, str(ROOT / "tests"))
    from vllm_sched import SAMPLED_TOKEN, SchedulerHarness, block_nbytes, complete_every_plan

    bs = 16
    extra: dict[str, Any] = {"cpu.capacity": 64 * block_nbytes(bs), "ssd.path": str(tmp / "ssd"),
                             "ssd.capacity": "8MiB"}
    if mode == "on" or mode == "disk full":
        extra["trace.path"], extra["trace.insecure_hashes"] = str(tmp / "rec"), True
    elif mode == "unwritable":
        (tmp / "file").write_text("")
        extra["trace.path"], extra["trace.insecure_hashes"] = str(tmp / "file" / "rec"), True
    if mode == "disk full":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
    h = SchedulerHarness(str(tmp / "model"), block_size=bs, num_gpu_blocks=64, kv_connector_extra_config=extra,
                         worker=complete_every_plan)
    rng = random.Random(0)
    system = [rng.randrange(2, 500) for _ in range(3 * bs)]
    convo: dict[int, list[int]] = {}
    seconds = 0.0
    try:
        for i in range(requests):
            user = rng.randrange(8)
            prompt = convo.get(user, system) + [rng.randrange(2, 500) for _ in range(rng.randint(10, 40))]
            if len(prompt) > 700:
                prompt = system + prompt[-40:]
            t0 = time.perf_counter()
            h.run_group([(str(i), prompt)], max_tokens=24)
            seconds += time.perf_counter() - t0
            convo[user] = prompt + [SAMPLED_TOKEN] * 24
        hits = h.connector._scheduler.stats()["hits"]  # type: ignore[union-attr]
        recorder = h.connector._scheduler._recorder  # type: ignore[union-attr]
        disabled = recorder.disabled if recorder is not None else None
    finally:
        h.close()
    return {"mode": mode, "ms_per_request": 1000 * seconds / requests, "hits": hits, "recording_stopped": disabled}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--child", nargs=2, metavar=("MODE", "DIR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.requests, Path(args.child[1]))))
        return 0
    sys.path.insert(0, str(ROOT / "tests"))
    from vllm_util import build_tiny_llama

    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-recorder-") as d:
        model = build_tiny_llama(Path(d) / "model")
        for r in range(args.repeat):
            for mode in MODES:
                tmp = Path(d) / f"{r}-{mode.replace(' ', '-')}"
                tmp.mkdir()
                (tmp / "model").symlink_to(model)
                out = subprocess.run([sys.executable, __file__, "--child", mode, str(tmp), "--requests",
                                      str(args.requests)], capture_output=True, text=True, check=True)
                runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = statistics.median(x["ms_per_request"] for x in runs["off"])
    hits = {json.dumps(x["hits"], sort_keys=True) for xs in runs.values() for x in xs}
    result = {"requests": args.requests, "repeat": args.repeat, "same_hits_in_every_mode": len(hits) == 1,
              "modes": {m: {"ms_per_request": statistics.median(x["ms_per_request"] for x in xs),
                            "ratio": statistics.median(x["ms_per_request"] for x in xs) / base,
                            "recording_stopped": xs[-1]["recording_stopped"]} for m, xs in runs.items()}}
    print("| recorder | scheduler ms per request (median) | ratio to off | recording |")
    print("|---|---:|---:|---|")
    for m, v in result["modes"].items():
        state = "off" if m == "off" else ("stopped: " + v["recording_stopped"] if v["recording_stopped"] else "on")
        print(f"| {m} | {v['ms_per_request']:.2f} | {v['ratio']:.3f}x | {state} |")
    print(f"same hits in every mode: {result['same_hits_in_every_mode']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["same_hits_in_every_mode"] else 1


if __name__ == "__main__":
    sys.exit(main())
