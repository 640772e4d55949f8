"""Load or recompute on the real vLLM engine: mean TTFT of vLLM alone, kvstrata with
``load.policy: always`` and with ``measured`` (the default), with the SSD tier at its real
speed and on a disk slower than recompute.

The slow disk is real (needs root and cgroup v1's blkio controller): the SSD tier lives
on an ext4 file system on a file-backed loop device, and the engines under test run in a
blkio cgroup whose ``blkio.throttle.read_bps_device`` limits that device's reads
(``tests/throttled_disk.py``; set up and removed here). The page cache is dropped before
every measured engine, so every read reaches the device.

A locally built Llama (random weights, 8 layers, hidden 1024, fp32: 512 KiB per 32-token
block), ``--prompts`` distinct prompts of ``--tokens`` tokens, one at a time, one output
token each: TTFT is the time of each request.

* a writer engine with kvstrata stores every prompt to the SSD tier (unthrottled);
* vLLM alone serves the prompts (it recomputes them: a new engine, no prefix cache yet);
* at the disk's real speed: a new engine with kvstrata, ``always``, then ``measured``;
* throttled to ``--read-mib`` MiB/s: the same two engines again.

Every engine serves a short unrelated prompt first (its warm-up, not timed), and gets the
same environment and compute threads (``VLLM_CPU_NUM_OF_RESERVED_CPU``, ``OMP_NUM_THREADS``).

    sudo .venv/bin/python benchmarks/bench_load_policy.py [--prompts 12] [--tokens 1024] [--read-mib 6]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from throttled_disk import ThrottledDisk, unavailable  # noqa: E402
from vllm_util import build_tiny_llama, random_token_prompt, run_in_subprocess  # noqa: E402

ENV = {"OMP_NUM_THREADS": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    return run_in_subprocess({**spec, "load_stats": True}, env=ENV, timeout=1800)


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = str(build_tiny_llama(work / "llama-8x1024", layers=8, hidden=1024, heads=16, kv_heads=4,
                                 intermediate=2816, vocab=2048, max_positions=8192))
    prompts = [random_token_prompt(args.tokens, seed=100 + i, vocab=2000) for i in range(args.prompts)]
    warm = random_token_prompt(64, seed=2, vocab=2000)
    common: dict[str, Any] = {"model": model, "max_tokens": 1, "kv_bytes": 256 * 1024**2, "max_model_len": 8192,
                              "steps": [{"prompts": [warm]}] + [{"prompts": [p]} for p in prompts]}
    out: dict[str, Any] = {}
    with ThrottledDisk(work / "disk", read_bps=args.read_mib << 20, size_mib=args.disk_mib) as disk:
        tier = {"cpu.capacity": "1GiB", "ssd.path": str(disk.mount / "ssd"), "ssd.capacity": f"{args.disk_mib // 2}MiB"}
        run({**common, "kvstrata": {**tier, "load.policy": "always"}})  # the writer: every prompt to the SSD tier
        reference = run(common)
        out["vllm alone"] = summary(reference)
        for speed in ("real speed", f"{args.read_mib} MiB/s"):
            for policy in ("always", "measured"):
                disk.drop_cache()
                cfg = {**tier, "load.policy": policy}
                if speed == "real speed":
                    result = run({**common, "kvstrata": cfg})
                else:
                    with disk.throttled():
                        result = run({**common, "kvstrata": cfg})
                out[f"{policy}, {speed}"] = summary(result, reference)
    return out


def summary(result: dict[str, Any], reference: dict[str, Any] | None = None) -> dict[str, Any]:
    steps = result["steps"][1:]
    ttft = [s["seconds"] for s in steps]
    out: dict[str, Any] = {"mean_ttft_s": statistics.fmean(ttft), "ttft_s": ttft,
                           "loaded_tokens": sum(s["external_hits"] for s in steps), "load": result.get("load")}
    if reference is not None:
        out["outputs_identical"] = all(a["tokens"] == b["tokens"] for a, b in zip(steps, reference["steps"][1:]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--read-mib", type=int, default=6, help="the throttled disk's read rate, MiB/s")
    ap.add_argument("--disk-mib", type=int, default=1024)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    why = unavailable()
    if why is not None:
        print(f"bench_load_policy: {why}", file=sys.stderr)
        return 2
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kvstrata-bench-load-"))
    out = measure(args, work)
    base = out["vllm alone"]["mean_ttft_s"]
    print(f"{args.prompts} prompts of {args.tokens} tokens, one at a time; mean TTFT against vLLM alone")
    for name, r in out.items():
        load = r.get("load") or {}
        decisions = {t: d for t, d in (load.get("decisions") or {}).items() if any(d.values())}
        print(f"  {name:24s} {r['mean_ttft_s'] * 1e3:8.1f} ms  {r['mean_ttft_s'] / base:6.2f}x  "
              f"loaded {r['loaded_tokens']:6d} tokens  decisions {decisions}  "
              f"identical: {r.get('outputs_identical', True)}")
    if args.json is not None:
        args.json.write_text(json.dumps({"argv": sys.argv[1:] if argv is None else list(argv), "results": out,
                                         "ratio_to_vllm_alone": {k: v["mean_ttft_s"] / base for k, v in out.items()}},
                                        indent=2) + "\n")
    return 0 if all(r.get("outputs_identical", True) for r in out.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
