"""What kvstrata costs a hybrid model. vLLM turns its hybrid memory allocator (HMA) off
for a KV connector that does not declare ``SupportsHMA``; kvstrata declares it, so
vLLM keeps it on. The third engine shows what turning it off costs (as with a
connector without ``SupportsHMA``: ``disable_hybrid_kv_cache_manager``).

A tiny Gemma-3 text model (random weights, 5 of 6 layers with a 64-token sliding
window) on vLLM's CPU engine with the same KV memory (``--kv-cache-memory-bytes``):
vLLM alone, with kvstrata, and with kvstrata and the allocator off. Eight 1,500-token
prompts are submitted at once and the engine is stepped by hand: the figure is the
most requests it ran at once (what the KV pool admits), with the KV cache groups and
blocks vLLM built, and the engine's wall time for all eight. Greedy outputs must be
identical; where an engine's differ, the script says where they first differ and how
close the two best tokens were there (random weights make near ties, which a
different batch composition or summation order flips).

    .venv/bin/python benchmarks/bench_hma.py [--kv-mib 16] [--prompts 8] [--tokens 1500] [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from vllm_util import build_tiny_gemma3  # noqa: E402


def engine(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine, in this process (run by :func:`main` in a child)."""
    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = dict(model=spec["model"], dtype="float32", block_size=32, enforce_eager=True, seed=0,
                              kv_cache_memory_bytes=spec["kv_mib"] * 1024**2, max_model_len=2048,
                              enable_prefix_caching=True)
    if spec["kvstrata"]:
        kw["kv_transfer_config"] = {"kv_connector": "KVStrataConnector", "kv_role": "kv_both",
                                    "kv_connector_module_path": "kvstrata.connectors.vllm",
                                    "kv_connector_extra_config": {"cpu.capacity": "64MiB", "ssd.capacity": 0,
                                                                  "load.policy": spec.get("load_policy", "measured")}}
    if spec.get("hma_off"):
        kw["disable_hybrid_kv_cache_manager"] = True
    llm = LLM(**kw)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    cfg = scheduler.kv_cache_manager.kv_cache_config
    groups = [(type(g.kv_cache_spec).__name__, len(g.layer_names)) for g in cfg.kv_cache_groups]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    peak, outputs, margins, seconds = 0, {}, {}, []
    for r in range(spec["rounds"]):  # new prompts each round: nothing is a prefix hit
        for i in range(spec["prompts"]):
            tokens = [(r * 101 + i * 37 + j * 11) % 500 + 2 for j in range(spec["tokens"])]
            engine.add_request(f"{r}-{i}", {"prompt_token_ids": tokens}, sp)
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
                    margins[out.request_id] = [_margin(lp) for lp in out.outputs[0].logprobs or []]
            peak = max(peak, len(scheduler.running))
        seconds.append(time.perf_counter() - t0)
    return {"peak_running": peak, "seconds": statistics.median(seconds), "num_blocks": int(cfg.num_blocks),
            "groups": groups, "outputs": [outputs[k] for k in sorted(outputs)],
            "margins": [margins[k] for k in sorted(outputs)]}


def _margin(logprobs: dict[int, Any]) -> float:
    """How far the greedy token's log-probability is above the runner-up's at one step."""
    top = sorted((lp.logprob for lp in logprobs.values()), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def divergence(base: dict[str, Any], other: dict[str, Any]) -> str:
    """Where ``other``'s greedy outputs first leave ``base``'s, and how close the choice was
    there (the log-probability margin between the two best tokens in each engine): a
    near tie (a margin of about 1e-3 or less) flips on a different summation order."""
    found = []
    for i, (a, b) in enumerate(zip(base["outputs"], other["outputs"])):
        pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if pos is not None:
            found.append((i, pos, base["margins"][i][pos], other["margins"][i][pos]))
    if not found:
        return "the same"
    worst = max(found, key=lambda f: min(f[2], f[3]))
    return (f"{len(found)} of {len(base['outputs'])} requests differ; the widest margin at a first difference "
            f"(request {worst[0]}, token {worst[1]}): {worst[2]:.2e} here, {worst[3]:.2e} there")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-mib", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=15, help="rounds of new prompts per engine (the median is shown)")
    ap.add_argument("--load-policy", choices=("measured", "always"), default="measured", help="kvstrata's load.policy")
    args = ap.parse_args(argv)
    model = build_tiny_gemma3(Path(tempfile.mkdtemp(prefix="kvstrata-hma-")) / "gemma3")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
           "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    results = {}
    for label, kvstrata, hma_off in (("vLLM alone (HMA on)", False, False), ("with kvstrata (HMA on)", True, False),
                                     ("with kvstrata, HMA off", True, True)):
        spec = {"model": str(model), "kvstrata": kvstrata, "kv_mib": args.kv_mib, "prompts": args.prompts,
                "tokens": args.tokens, "hma_off": hma_off, "rounds": args.rounds, "load_policy": args.load_policy}
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                              text=True, env=env, cwd=ROOT)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(proc.stdout[-3000:], proc.stderr[-3000:])
            return 1
        results[label] = json.loads(line[7:])
    base = results["vLLM alone (HMA on)"]
    print(f"tiny Gemma-3 (5 of 6 layers sliding, window 64), {args.kv_mib} MiB of KV, "
          f"{args.prompts} prompts of {args.tokens} tokens at once; median of {args.rounds} rounds")
    for label, r in results.items():
        print(f"  {label:<24} KV groups {r['groups']}, {r['num_blocks']} blocks; at most {r['peak_running']} "
              f"request(s) at once; {r['seconds']:.2f} s  ({r['seconds'] / base['seconds']:.2f}x)")
    same = all(r["outputs"] == base["outputs"] for r in results.values())
    print(f"  outputs identical: {same}")
    for label, r in results.items():
        if r["outputs"] != base["outputs"]:
            print(f"    {label}: {divergence(base, r)}")
    return 0 if same else 1


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(engine(json.loads(sys.argv[2]))), flush=True)
    else:
        sys.exit(main())
