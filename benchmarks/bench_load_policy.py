"""Load or recompute on the real vLLM engine: mean TTFT of vLLM alone, kvstrata with
``load.policy: always`` and with ``measured`` (the default), with the SSD tier at its real
speed and on a disk slower than recompute, and with a remote tier at its real speed and
behind a slow server.

The slow disk is real (needs root and cgroup v1's blkio controller): the SSD tier lives
on an ext4 file system on a file-backed loop device, and the engines under test run in a
blkio cgroup whose ``blkio.throttle.read_bps_device`` limits that device's reads
(``tests/throttled_disk.py``; set up and removed here). The page cache is dropped before
every measured engine, so every read reaches the device.

A locally built Llama (random weights, 8 layers, hidden 1024, fp32: 512 KiB per 32-token
block), ``--prompts`` distinct prompts of ``--tokens`` tokens, one at a time, one output
token each: TTFT is the time of each request.

* a writer engine with kvstrata stores every prompt to the SSD tier (unthrottled);
* vLLM alone serves the prompts (it recomputes them: a new engine, no prefix cache yet),
  first and last (this machine's drift);
* kvstrata with nothing below to hit (a DRAM tier that starts empty): what recomputing
  costs with kvstrata attached, storing what it computes;
* at the disk's real speed: a new engine with kvstrata, ``always``, then ``measured``;
* throttled to ``--read-mib`` MiB/s: the same two engines again;
* the remote tier: a writer engine stores every prompt to a real ``valkey-server`` on
  loopback; then new engines with no SSD tier and an empty DRAM tier, ``always`` and
  ``measured``, fetch from it directly and through a proxy that delivers the server's
  answers at ``--read-mib`` MiB/s (``tests/slow_proxy.py``).

Every engine first serves four unrelated prompts of 64 to 1,024 tokens (its warm-up, not
timed: prefills of several sizes, as a serving engine sees, from which ``measured`` tells
what a step costs whatever it computes from what a token costs), then idles ``IDLE_S``
(the first seconds after an engine starts run its forward up to 2-3x slower on this
machine, with kvstrata or without: a request timed then measures the start, not the
policy), and gets the same environment and compute threads
(``VLLM_CPU_NUM_OF_RESERVED_CPU``, ``OMP_NUM_THREADS``).

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

from slow_proxy import SlowProxy  # noqa: E402
from throttled_disk import ThrottledDisk, unavailable  # noqa: E402
from valkey_server import ValkeyServer, secret_file  # noqa: E402
from vllm_util import build_tiny_llama, random_token_prompt, run_in_subprocess  # noqa: E402

ENV = {"OMP_NUM_THREADS": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
WARM_UP = (64, 256, 1024, 128)  # tokens of each warm-up prompt
IDLE_S = 5.0  # after the warm-up: an engine's first seconds run slower here, with or without kvstrata
TIMED_FROM = len(WARM_UP) + 1  # the steps timed: after the warm-up and the idle step


def run(spec: dict[str, Any]) -> dict[str, Any]:
    return run_in_subprocess({**spec, "load_stats": True}, env=ENV, timeout=1800)


def scenario(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The model and the steps every engine runs (the warm-up prompts, then the timed ones)."""
    model = str(build_tiny_llama(work / "llama-8x1024", layers=8, hidden=1024, heads=16, kv_heads=4,
                                 intermediate=2816, vocab=2048, max_positions=8192))
    prompts = [random_token_prompt(args.tokens, seed=100 + i, vocab=2000) for i in range(args.prompts)]
    warm = [random_token_prompt(n, seed=2 + i, vocab=2000) for i, n in enumerate(WARM_UP)]
    return {"model": model, "max_tokens": 1, "kv_bytes": 256 * 1024**2, "max_model_len": 8192,
            "steps": [{"prompts": [w]} for w in warm] + [{"idle": IDLE_S}] + [{"prompts": [p]} for p in prompts]}


def measure(args: argparse.Namespace, work: Path, real_speed: bool = True, ssd: bool = True,
            remote: bool = True) -> dict[str, Any]:
    """Mean TTFT of every engine (``real_speed``: the unthrottled ones too)."""
    common = scenario(args, work)
    out: dict[str, Any] = {}
    reference = run(common)
    out["vllm alone"] = summary(reference)
    out["kvstrata, nothing to hit"] = summary(run({**common, "kvstrata": {"cpu.capacity": "1GiB", "ssd.capacity": 0}}),
                                              reference)
    if ssd:
        _ssd(args, work, common, reference, real_speed, out)
    if remote:
        _remote(args, work, common, reference, real_speed, out)
    out["vllm alone, again"] = summary(run(common), reference)  # this machine's drift over the run
    return out


def baseline(out: dict[str, Any]) -> dict[str, float]:
    """vLLM alone's mean and median TTFT over both of its runs (the ratios' denominators)."""
    ttft = [t for k in ("vllm alone", "vllm alone, again") if k in out for t in out[k]["ttft_s"]]
    return {"mean": statistics.fmean(ttft), "median": statistics.median(ttft)}


def _ssd(args: argparse.Namespace, work: Path, common: dict[str, Any], reference: dict[str, Any],
         real_speed: bool, out: dict[str, Any]) -> None:
    with ThrottledDisk(work / "disk", read_bps=args.read_mib << 20, size_mib=args.disk_mib) as disk:
        tier = {"cpu.capacity": "1GiB", "ssd.path": str(disk.mount / "ssd"), "ssd.capacity": f"{args.disk_mib // 2}MiB"}
        run({**common, "kvstrata": {**tier, "load.policy": "always"}})  # the writer: every prompt to the SSD tier
        for speed in ("real speed", f"{args.read_mib} MiB/s")[0 if real_speed else 1:]:
            for policy in ("always", "measured"):
                disk.drop_cache()
                cfg = {**tier, "load.policy": policy}
                if speed == "real speed":
                    result = run({**common, "kvstrata": cfg})
                else:
                    with disk.throttled():
                        result = run({**common, "kvstrata": cfg})
                out[f"{policy}, SSD {speed}"] = summary(result, reference)


def _remote(args: argparse.Namespace, work: Path, common: dict[str, Any], reference: dict[str, Any],
            real_speed: bool, out: dict[str, Any]) -> None:
    with ValkeyServer(maxmemory="1gb") as server:
        tier = {"cpu.capacity": "1GiB", "ssd.capacity": 0, "remote.secret_file": secret_file(work)}
        run({**common, "kvstrata": {**tier, "remote.url": server.url, "load.policy": "always"}})  # the writer
        with SlowProxy(server.port, bps=args.read_mib << 20) as proxy:
            slow = f"redis://127.0.0.1:{proxy.port}/0"
            for speed, url in (("real speed", server.url), (f"{args.read_mib} MiB/s", slow))[0 if real_speed else 1:]:
                for policy in ("always", "measured"):
                    result = run({**common, "kvstrata": {**tier, "remote.url": url, "load.policy": policy}})
                    out[f"{policy}, remote {speed}"] = summary(result, reference)


def summary(result: dict[str, Any], reference: dict[str, Any] | None = None) -> dict[str, Any]:
    steps = result["steps"][TIMED_FROM:]
    ttft = [s["seconds"] for s in steps]
    out: dict[str, Any] = {"mean_ttft_s": statistics.fmean(ttft), "median_ttft_s": statistics.median(ttft),
                           "ttft_s": ttft,
                           "steps": [{k: s.get(k) for k in ("seconds", "external_hits", "cached", "load")} for s in steps],
                           "loaded_tokens": sum(s["external_hits"] for s in steps), "load": result.get("load")}
    if reference is not None:
        out["outputs_identical"] = all(a["tokens"] == b["tokens"]
                                       for a, b in zip(steps, reference["steps"][TIMED_FROM:]))
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
    base = baseline(out)
    print(f"{args.prompts} prompts of {args.tokens} tokens, one at a time; TTFT against vLLM alone (both of its runs): "
          f"mean {base['mean'] * 1e3:.1f} ms, median {base['median'] * 1e3:.1f} ms")
    ratios = {k: {"mean": v["mean_ttft_s"] / base["mean"], "median": v["median_ttft_s"] / base["median"]}
              for k, v in out.items()}
    for name, r in out.items():
        load = r.get("load") or {}
        decisions = {t: d for t, d in (load.get("decisions") or {}).items() if any(d.values())}
        print(f"  {name:27s} mean {r['mean_ttft_s'] * 1e3:7.1f} ms {ratios[name]['mean']:5.2f}x  "
              f"median {r['median_ttft_s'] * 1e3:7.1f} ms {ratios[name]['median']:5.2f}x  "
              f"loaded {r['loaded_tokens']:6d} tokens  decisions {decisions}  "
              f"identical: {r.get('outputs_identical', True)}")
    if args.json is not None:
        args.json.write_text(json.dumps({"argv": sys.argv[1:] if argv is None else list(argv), "results": out,
                                         "vllm_alone": base, "ratio_to_vllm_alone": ratios}, indent=2) + "\n")
    return 0 if all(r.get("outputs_identical", True) for r in out.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
