"""Time to first token on the real vLLM engine: recompute vs kvstrata's CPU tier vs its SSD tier.

A locally built Llama (random weights, default 8 layers, hidden 1024) so that
prefill costs real compute; a ~3K-token prompt; greedy, one output token.
``--model qwen3-next``: a state hybrid instead (Gated DeltaNet beside full
attention, bf16), whose hits load the linear-attention state at the hit point.

* recompute: an engine without kvstrata, after a warm-up request;
* CPU tier: an engine with kvstrata serves the prompt once, ``reset_prefix_cache()``
  empties vLLM's own cache, the prompt is timed again (median of repeats);
* SSD tier: a new engine process with the same SSD path (its CPU tier empty),
  the SSD files' pages dropped from the OS cache first (``POSIX_FADV_DONTNEED``);
  it first loads another stored long prompt (warming the long-sequence path
  and the load code), then the timed prompt, whose records are still cold;
* remote tier: a real ``valkey-server`` on loopback (``tests/valkey_server.py``);
  engine A (its own SSD path) serves both long prompts and writes them to the
  shared tier; a new engine B with another SSD path and an empty DRAM tier
  fetches the warm-up prompt from it, then the timed one.

Then the time each decode step spends inside kvstrata's worker-side hooks (the
sum over the hooks vLLM calls in a step, median and P99 in microseconds), with
every computed block stored, and with no stores (four requests decoding).

Every phase runs in its own process; the printed figures are ratios against
the recompute time measured in the same run.

Every engine, with kvstrata and without, gets the same environment
(:func:`engine_env`), so that both compute on the same threads: vLLM's CPU
backend reserves one core when it starts its workers through its
multiprocessing executor, and one more when a KV connector is configured (on
2 cores it then reserves none, so an engine with kvstrata would compute on 2
threads and one without on 1). ``VLLM_CPU_NUM_OF_RESERVED_CPU`` fixes the
count for both (``--reserved-cpus``, default 1), ``OMP_NUM_THREADS`` the
threads of an in-process engine (``--omp-threads``; vLLM's binding overrides it
in a multiprocessing engine). Each engine reports the compute threads its
worker runs with (torch's thread count, the affinity, the OpenMP settings) and
the OpenMP binding vLLM logged; the script prints them, writes them to
``--json``, and exits 1 when two engines differ. ``--multiprocessing`` starts
the engines as a server does (the MP executor, where the reservation
applies); by default they run in-process (vLLM binds nothing there), and the
hook timing needs that.

    .venv/bin/python benchmarks/bench_vllm.py [--tokens 3072] [--layers 8] [--hidden 1024] [--decode-tokens 128]
        [--multiprocessing] [--reserved-cpus 1] [--omp-threads 2] [--json out.json]
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

from benchutil import drop_page_cache  # noqa: E402
from valkey_server import ValkeyServer, secret_file  # noqa: E402
from vllm_util import build_tiny_llama, build_tiny_qwen3_next, random_token_prompt, run_in_subprocess  # noqa: E402


# What decides a worker's compute threads (compared between engines).
_BINDING_KEYS = ("torch_threads", "affinity", "OMP_NUM_THREADS", "OMP_PLACES", "GOMP_CPU_AFFINITY")


def engine_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment every engine process gets, with kvstrata and without alike. INFO
    logging: vLLM logs its OpenMP binding at that level."""
    env = {"OMP_NUM_THREADS": str(args.omp_threads), "VLLM_LOGGING_LEVEL": "INFO"}
    if args.reserved_cpus != "vllm":  # "vllm": vLLM's own default (unequal on small machines)
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(int(args.reserved_cpus))
    return env


class Engines:
    """Runs every engine of the benchmark with the same environment and keeps what each
    reported about its compute threads."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.env = engine_env(args)
        self.multiprocessing = bool(args.multiprocessing)
        self.reports: list[dict[str, Any]] = []

    def run(self, label: str, spec: dict[str, Any]) -> dict[str, Any]:
        result = run_in_subprocess(spec, multiprocessing=self.multiprocessing, env=self.env)
        self.reports.append({"engine": label, "kvstrata": spec.get("kvstrata") is not None,
                             "executor": result.get("executor"), "threads": result.get("threads", []),
                             "omp_binding_log": result.get("omp_binding_log", [])})
        return result

    @staticmethod
    def binding(report: dict[str, Any]) -> list[dict[str, Any]]:
        """Per worker, what decides its compute threads."""
        return [{k: w.get(k) for k in _BINDING_KEYS} for w in report["threads"]]

    def same_threads(self) -> bool:
        """Every engine (with kvstrata and without) computes on the same threads."""
        seen = [json.dumps(self.binding(r), sort_keys=True) for r in self.reports]
        return bool(seen) and all(r["threads"] for r in self.reports) and len(set(seen)) == 1

    def describe(self) -> list[str]:
        lines = []
        for r in self.reports:
            workers = "; ".join(f"{w.get('torch_threads')} threads, affinity {w.get('affinity')}, "
                                f"OMP_NUM_THREADS={w.get('OMP_NUM_THREADS')}, "
                                f"GOMP_CPU_AFFINITY={w.get('GOMP_CPU_AFFINITY')!r}" for w in r["threads"])
            log = next((x for x in r["omp_binding_log"] if "reserve_cpu_num" in x), None)
            cores = [x for x in r["omp_binding_log"] if "core ids" in x or "reserved_cpus" in x]
            vllm = f"; vLLM: {log}, {', '.join(cores)}" if log else "; vLLM logged no OpenMP binding"
            lines.append(f"  {r['engine']:28s} ({'kvstrata' if r['kvstrata'] else 'no connector'}, "
                         f"{r['executor']} executor): {workers}{vllm}")
        return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("llama", "qwen3-next"), default="llama",
                    help="llama (fp32, block 32) or a state hybrid: qwen3-next (Gated DeltaNet and full attention, "
                         "bf16, vLLM's block size: its state page)")
    ap.add_argument("--tokens", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--multiprocessing", action="store_true",
                    help="start engines with vLLM's MP executor (as a server does); default in-process")
    ap.add_argument("--reserved-cpus", default="1",
                    help="VLLM_CPU_NUM_OF_RESERVED_CPU for every engine; 'vllm' leaves it unset")
    ap.add_argument("--omp-threads", type=int, default=2, help="OMP_NUM_THREADS for every engine")
    ap.add_argument("--json", type=Path, default=None, help="write the figures and each engine's threads here")
    args = ap.parse_args(argv)
    engines = Engines(args)

    work = args.workdir or Path(tempfile.mkdtemp(prefix="kvstrata-bench-vllm-"))
    heads = args.hidden // 64
    common: dict[str, Any] = {"max_tokens": 1, "kv_bytes": 512 * 1024**2, "max_model_len": 8192}
    if args.model == "qwen3-next":
        model = str(build_tiny_qwen3_next(work / f"qwen3next-{args.layers}x{args.hidden}", layers=args.layers,
                                          hidden=args.hidden, vocab=2048))
        common["engine"] = {"dtype": "bfloat16", "block_size": None}
        described = (f"tiny Qwen3-Next: {args.layers} layers (3 Gated DeltaNet to 1 full attention), hidden "
                     f"{args.hidden}, bf16; prompt {args.tokens} tokens; vLLM's block (the state page)")
    else:
        model = str(build_tiny_llama(work / f"llama-{args.layers}x{args.hidden}", layers=args.layers,
                                     hidden=args.hidden, heads=heads, kv_heads=max(1, heads // 4),
                                     intermediate=args.hidden * 11 // 4, vocab=2048, max_positions=8192))
        described = (f"{args.layers} layers, hidden {args.hidden}, {heads} heads, {max(1, heads // 4)} KV heads, "
                     f"fp32; prompt {args.tokens} tokens; block 32")
    common["model"] = model
    prompt = random_token_prompt(args.tokens, seed=1, vocab=2000)
    warm = random_token_prompt(64, seed=2, vocab=2000)
    warm_long = random_token_prompt(args.tokens, seed=3, vocab=2000)  # warms the long-sequence path
    ssd = work / "ssd"
    tier = {"cpu.capacity": "2GiB", "ssd.path": str(ssd), "ssd.capacity": "4GiB"}

    base = engines.run("recompute", {**common, "steps": [{"prompts": [warm]}]
                                     + [{"prompts": [prompt]}, {"reset": True}] * args.repeats})["steps"]
    recompute = statistics.median(s["seconds"] for s in base[1::2])
    reference = base[1]["tokens"][0]

    steps = ([{"prompts": [warm]}, {"prompts": [warm_long]}, {"prompts": [prompt]}]
             + [{"reset": True}, {"prompts": [prompt]}] * args.repeats)
    cpu_run = engines.run("CPU tier", {**common, "kvstrata": tier, "steps": steps})["steps"]
    cpu_steps = cpu_run[4::2]
    cpu = statistics.median(s["seconds"] for s in cpu_steps)

    drop_page_cache(ssd)
    ssd_run = engines.run("SSD tier", {**common, "kvstrata": tier,
                                       "steps": [{"prompts": [warm]}, {"prompts": [warm_long]},
                                                 {"prompts": [prompt]}]})["steps"]
    ssd_step = ssd_run[2]

    with ValkeyServer(maxmemory="1gb") as server:
        shared = {"cpu.capacity": "2GiB", "ssd.capacity": "4GiB", "remote.url": server.url,
                  "remote.secret_file": secret_file(work)}
        engines.run("remote writer", {**common, "kvstrata": {**shared, "ssd.path": str(work / "ssd-a")},
                                      "steps": [{"prompts": [warm_long]}, {"prompts": [prompt]}]})
        remote_run = engines.run("remote tier", {**common, "kvstrata": {**shared, "ssd.path": str(work / "ssd-b")},
                                                 "steps": [{"prompts": [warm]}, {"prompts": [warm_long]},
                                                           {"prompts": [prompt]}]})["steps"]
    remote_step = remote_run[2]

    # The hooks are timed inside the engine's process: in-process engines only.
    hooks = None if args.multiprocessing else hook_times(engines, args, common, tier, warm)
    same = all(s["tokens"][0] == reference for s in [*cpu_steps, ssd_step, remote_step])
    same_threads = engines.same_threads()
    print(f"model: {described}")
    print(f"engines: {'multiprocessing (MP executor)' if args.multiprocessing else 'in-process'}, "
          f"environment of every engine: {engines.env}")
    print(f"compute threads, the same for every engine: {same_threads}")
    print("\n".join(engines.describe()))
    print(f"recompute TTFT   {recompute * 1e3:8.1f} ms   1.00x")
    print(f"CPU-tier TTFT    {cpu * 1e3:8.1f} ms   {cpu / recompute:.3f}x   "
          f"(loaded {cpu_steps[0]['external_hits']} tokens; target <= 0.2x)")
    print(f"SSD-tier TTFT    {ssd_step['seconds'] * 1e3:8.1f} ms   {ssd_step['seconds'] / recompute:.3f}x   "
          f"(loaded {ssd_step['external_hits']} tokens, cold page cache; target <= 0.3x)")
    print(f"remote-tier TTFT {remote_step['seconds'] * 1e3:8.1f} ms   {remote_step['seconds'] / recompute:.3f}x   "
          f"(loaded {remote_step['external_hits']} tokens from valkey on loopback; target <= 0.3x)")
    if hooks is None:
        print("decode step inside the connector's hooks: not measured (in-process engines only)")
    for label, times in (("with stores", hooks[0]), ("without stores", hooks[1])) if hooks else ():
        print(f"decode step inside the connector's hooks, {label:14s}: median {_pct(times, 50):7.1f} us, "
              f"P99 {_pct(times, 99):7.1f} us ({len(times)} steps)")
    print(f"outputs identical to recompute: {same}")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "argv": sys.argv[1:] if argv is None else list(argv),
            "multiprocessing": bool(args.multiprocessing), "env": engines.env,
            "same_threads": same_threads, "engines": engines.reports,
            "ttft_seconds": {"recompute": recompute, "cpu": cpu, "ssd": ssd_step["seconds"],
                             "remote": remote_step["seconds"]},
            "ratio_to_recompute": {"cpu": cpu / recompute, "ssd": ssd_step["seconds"] / recompute,
                                   "remote": remote_step["seconds"] / recompute},
            "loaded_tokens": {"cpu": cpu_steps[0]["external_hits"], "ssd": ssd_step["external_hits"],
                              "remote": remote_step["external_hits"]},
            "hook_us": None if hooks is None else {
                label: {"median": _pct(t, 50), "p99": _pct(t, 99), "steps": len(t)}
                for label, t in (("with_stores", hooks[0]), ("without_stores", hooks[1]))},
            "outputs_identical": same}, indent=2) + "\n")
    return 0 if same and same_threads else 1


def hook_times(engines: Engines, args: argparse.Namespace, common: dict, tier: dict,
               warm: list[int]) -> tuple[list[float], list[float]]:
    """Seconds per decode step inside kvstrata's worker-side hooks: four 512-token prompts
    decoding ``--decode-tokens`` tokens, with every computed block stored (``on_compute``)
    and with no stores at all (``on_evict`` in a KV cache nothing is evicted from)."""
    prompts = [random_token_prompt(512, seed=10 + i, vocab=2000) for i in range(4)]

    def run(label: str, extra: dict) -> list[float]:
        spec = {**common, "max_tokens": args.decode_tokens, "kvstrata": extra, "hook_timing": True,
                "steps": [{"prompts": [warm]}, {"prompts": prompts}]}
        return engines.run(label, spec)["steps"][1]["hook_seconds"][1:]  # the prefill step left out

    return (run("hooks, with stores", tier),
            run("hooks, without stores", {**tier, "spill.admission": "on_evict"}))


def _pct(seconds: list[float], q: float) -> float:
    """The ``q``-th percentile in microseconds (nearest rank)."""
    ordered = sorted(seconds)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))] * 1e6 if ordered else 0.0


if __name__ == "__main__":
    sys.exit(main())
