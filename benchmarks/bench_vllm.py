"""Time to first token on the real vLLM engine: recompute vs tierkv's CPU tier vs its SSD tier.

A locally built Llama (random weights, default 8 layers, hidden 1024) so that
prefill costs real compute; a ~3K-token prompt; greedy, one output token.

* recompute: an engine without tierkv, after a warm-up request;
* CPU tier: an engine with tierkv serves the prompt once, ``reset_prefix_cache()``
  empties vLLM's own cache, the prompt is timed again (median of repeats);
* SSD tier: a new engine process with the same SSD path (its CPU tier empty),
  the SSD files' pages dropped from the OS cache first (``POSIX_FADV_DONTNEED``);
  it first loads another stored long prompt (warming the long-sequence path
  and the load code), then the timed prompt, whose records are still cold.

Then the time each decode step spends inside tierkv's worker-side hooks (the
sum over the hooks vLLM calls in a step, median and P99 in microseconds), with
every computed block stored, and with no stores (four requests decoding).

Every phase runs in its own process; the printed figures are ratios against
the recompute time measured in the same run.

    .venv/bin/python benchmarks/bench_vllm.py [--tokens 3072] [--layers 8] [--hidden 1024] [--decode-tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from benchutil import drop_page_cache  # noqa: E402
from vllm_util import build_tiny_llama, random_token_prompt, run_in_subprocess  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()

    work = args.workdir or Path(tempfile.mkdtemp(prefix="tierkv-bench-vllm-"))
    heads = args.hidden // 64
    model = str(build_tiny_llama(work / f"llama-{args.layers}x{args.hidden}", layers=args.layers,
                                 hidden=args.hidden, heads=heads, kv_heads=max(1, heads // 4),
                                 intermediate=args.hidden * 11 // 4, vocab=2048, max_positions=8192))
    prompt = random_token_prompt(args.tokens, seed=1, vocab=2000)
    warm = random_token_prompt(64, seed=2, vocab=2000)
    warm_long = random_token_prompt(args.tokens, seed=3, vocab=2000)  # warms the long-sequence path
    common = {"model": model, "max_tokens": 1, "kv_bytes": 512 * 1024**2, "max_model_len": 8192}
    ssd = work / "ssd"
    tier = {"cpu.capacity": "2GiB", "ssd.path": str(ssd), "ssd.capacity": "4GiB"}

    base = run_in_subprocess({**common, "steps": [{"prompts": [warm]}] + [{"prompts": [prompt]}, {"reset": True}]
                              * args.repeats})["steps"]
    recompute = statistics.median(s["seconds"] for s in base[1::2])
    reference = base[1]["tokens"][0]

    steps = ([{"prompts": [warm]}, {"prompts": [warm_long]}, {"prompts": [prompt]}]
             + [{"reset": True}, {"prompts": [prompt]}] * args.repeats)
    cpu_run = run_in_subprocess({**common, "tierkv": tier, "steps": steps})["steps"]
    cpu_steps = cpu_run[4::2]
    cpu = statistics.median(s["seconds"] for s in cpu_steps)

    drop_page_cache(ssd)
    ssd_run = run_in_subprocess({**common, "tierkv": tier,
                                 "steps": [{"prompts": [warm]}, {"prompts": [warm_long]},
                                           {"prompts": [prompt]}]})["steps"]
    ssd_step = ssd_run[2]

    with_stores, without = hook_times(args, common, tier, warm)
    same = all(s["tokens"][0] == reference for s in [*cpu_steps, ssd_step])
    print(f"model: {args.layers} layers, hidden {args.hidden}, {heads} heads, "
          f"{max(1, heads // 4)} KV heads, fp32; prompt {args.tokens} tokens; block 32")
    print(f"recompute TTFT   {recompute * 1e3:8.1f} ms   1.00x")
    print(f"CPU-tier TTFT    {cpu * 1e3:8.1f} ms   {cpu / recompute:.3f}x   "
          f"(loaded {cpu_steps[0]['external_hits']} tokens; target <= 0.2x)")
    print(f"SSD-tier TTFT    {ssd_step['seconds'] * 1e3:8.1f} ms   {ssd_step['seconds'] / recompute:.3f}x   "
          f"(loaded {ssd_step['external_hits']} tokens, cold page cache; target <= 0.3x)")
    for label, times in (("with stores", with_stores), ("without stores", without)):
        print(f"decode step inside the connector's hooks, {label:14s}: median {_pct(times, 50):7.1f} us, "
              f"P99 {_pct(times, 99):7.1f} us ({len(times)} steps)")
    print(f"outputs identical to recompute: {same}")
    return 0 if same else 1


def hook_times(args: argparse.Namespace, common: dict, tier: dict, warm: list[int]) -> tuple[list[float], list[float]]:
    """Seconds per decode step inside tierkv's worker-side hooks: four 512-token prompts
    decoding ``--decode-tokens`` tokens, with every computed block stored (``on_compute``)
    and with no stores at all (``on_evict`` in a KV cache nothing is evicted from)."""
    prompts = [random_token_prompt(512, seed=10 + i, vocab=2000) for i in range(4)]

    def run(extra: dict) -> list[float]:
        spec = {**common, "max_tokens": args.decode_tokens, "tierkv": extra, "hook_timing": True,
                "steps": [{"prompts": [warm]}, {"prompts": prompts}]}
        return run_in_subprocess(spec)["steps"][1]["hook_seconds"][1:]  # the prefill step left out

    return run(tier), run({**tier, "spill.admission": "on_evict"})


def _pct(seconds: list[float], q: float) -> float:
    """The ``q``-th percentile in microseconds (nearest rank)."""
    ordered = sorted(seconds)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))] * 1e6 if ordered else 0.0


if __name__ == "__main__":
    sys.exit(main())
