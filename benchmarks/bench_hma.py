"""What kvstrata costs a hybrid model. vLLM turns its hybrid memory allocator (HMA) off
for a KV connector that does not declare ``SupportsHMA``; kvstrata declares it, so
vLLM keeps it on. The third engine shows what turning it off costs (as with a
connector without ``SupportsHMA``: ``disable_hybrid_kv_cache_manager``).

A tiny Gemma-3 text model (random weights, 5 of 6 layers with a 64-token sliding
window) on vLLM's CPU engine with the same KV memory (``--kv-cache-memory-bytes``):
vLLM alone, with kvstrata, and with kvstrata and the allocator off. Eight 1,500-token
prompts are submitted at once and the engine is stepped by hand: the figure is the
most requests it ran at once (what the KV pool admits), with the KV cache groups and
blocks vLLM built, and the engine's wall time for all eight.

The engines run at the same time, each in its own process, and take turns: every
round, each engine in turn serves eight new prompts while the others wait (an order that
rotates from round to round, after a pause that lets the last engine's compute threads
go idle). A round's time is compared with vLLM alone's time for the same round, so this
machine's drift over minutes, which moved separate runs of the same engine by a third,
falls on both sides of each ratio. A second vLLM alone, in a process of its own, is the
control: how far two identical engines differ here. Each engine's first round is its
warm-up, not timed; the median of those ratios and its quartiles are shown.
Greedy outputs must be identical; where an engine's differ, the script says where they first differ and how
close the two best tokens were there (random weights make near ties, which a
different batch composition or summation order flips).

    .venv/bin/python benchmarks/bench_hma.py [--kv-mib 16] [--prompts 8] [--tokens 1500] [--rounds 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from vllm_util import EngineProcess, build_tiny_gemma3, take_turns  # noqa: E402


def build(spec: dict[str, Any]) -> Any:
    """One engine, in this process (run by :func:`main` in a child)."""
    from vllm import LLM

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
    return LLM(**kw).llm_engine


def run_round(engine: Any, spec: dict[str, Any], r: int) -> dict[str, Any]:
    """Round ``r``: ``spec["prompts"]`` new prompts at once (nothing is a prefix hit), the
    engine stepped until they finish."""
    from vllm import SamplingParams

    scheduler = engine.engine_core.engine_core.scheduler
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    peak, outputs, margins = 0, {}, {}
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
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "peak_running": peak, "outputs": [outputs[k] for k in sorted(outputs)],
            "margins": [margins[k] for k in sorted(outputs)]}


def serve(spec: dict[str, Any]) -> None:
    """The child: build the engine, say what vLLM built, then run each round asked for on
    stdin (one line, its number) until stdin closes."""
    engine = build(spec)
    cfg = engine.engine_core.engine_core.scheduler.kv_cache_manager.kv_cache_config
    groups = [(type(g.kv_cache_spec).__name__, len(g.layer_names)) for g in cfg.kv_cache_groups]
    print("READY " + json.dumps({"num_blocks": int(cfg.num_blocks), "groups": groups}), flush=True)
    for line in sys.stdin:
        print("ROUND " + json.dumps(run_round(engine, spec, int(line))), flush=True)


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


ENGINES = (("vLLM alone (HMA on)", False, False), ("vLLM alone, a second process", False, False),
           ("with kvstrata (HMA on)", True, False), ("with kvstrata, HMA off", True, True))
WARM_UP = 1  # rounds each engine serves first, not timed (its first steps run slower, kvstrata or not)
PAUSE_S = 0.5  # before each engine's turn: the engine before it has stopped (its compute threads idle)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-mib", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=15, help="rounds of new prompts, each engine in turn")
    ap.add_argument("--load-policy", choices=("measured", "always"), default="measured", help="kvstrata's load.policy")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvstrata-hma-"))
    model = build_tiny_gemma3(work / "gemma3")
    children: dict[str, EngineProcess] = {}
    try:
        for n, (label, kvstrata, hma_off) in enumerate(ENGINES):  # one start at a time
            spec = {"model": str(model), "kvstrata": kvstrata, "kv_mib": args.kv_mib, "prompts": args.prompts,
                    "tokens": args.tokens, "hma_off": hma_off, "load_policy": args.load_policy}
            children[label] = EngineProcess(spec, work / f"engine-{n}.log",
                                            cmd=[sys.executable, __file__, "--child", json.dumps(spec)])
        rounds = take_turns(children, list(range(WARM_UP + args.rounds)), tag="ROUND", pause_s=PAUSE_S)
    finally:
        for child in children.values():
            child.close()
    results = {label: summarise(children[label].ready, rounds[label][WARM_UP:]) for label in children}
    base_label = ENGINES[0][0]
    base = results[base_label]
    print(f"tiny Gemma-3 (5 of 6 layers sliding, window 64), {args.kv_mib} MiB of KV, "
          f"{args.prompts} prompts of {args.tokens} tokens at once; {args.rounds} rounds, the engines in turn")
    for label, res in results.items():
        ratios = sorted(a / b for a, b in zip(res["round_seconds"], base["round_seconds"]))
        res["ratio"] = {"median": statistics.median(ratios), "q1": ratios[len(ratios) // 4],
                        "q3": ratios[(3 * len(ratios)) // 4], "rounds": ratios}
        print(f"  {label:<24} KV groups {res['groups']}, {res['num_blocks']} blocks; at most {res['peak_running']} "
              f"request(s) at once; median round {res['seconds']:.3f} s; round by round vs vLLM alone: median "
              f"{res['ratio']['median']:.2f}x (quartiles {res['ratio']['q1']:.2f}x-{res['ratio']['q3']:.2f}x)")
    same = all(r["outputs"] == base["outputs"] for r in results.values())
    print(f"  outputs identical: {same}")
    for label, res in results.items():
        if res["outputs"] != base["outputs"]:
            print(f"    {label}: {divergence(base, res)}")
    if args.json is not None:
        args.json.write_text(json.dumps({"argv": sys.argv[1:] if argv is None else list(argv),
                                         "results": {k: {**v, "outputs": None, "margins": None}
                                                     for k, v in results.items()}}, indent=2) + "\n")
    return 0 if same else 1


def summarise(built: dict[str, Any], rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine over its rounds: what vLLM built, its median round, its outputs in order."""
    return {**built, "seconds": statistics.median(r["seconds"] for r in rounds),
            "round_seconds": [r["seconds"] for r in rounds],
            "peak_running": max(r["peak_running"] for r in rounds),
            "outputs": [o for r in rounds for o in r["outputs"]], "margins": [m for r in rounds for m in r["margins"]]}


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        serve(json.loads(sys.argv[2]))
    else:
        sys.exit(main())
