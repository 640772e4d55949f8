"""kvstrata.engine end to end: throughput, multi-turn TTFT with and without the tiers
below the pool, and what an FP8 KV cache costs in accuracy.

A random-weight Llama (8 layers, hidden 512, 8 query heads of 64 on 2 KV heads,
float32) written by transformers:

* throughput: one batched prefill of ``--batch`` prompts of ``--prompt-tokens``,
  then ``--decode-steps`` batched decode steps; tokens per second of each;
* multi-turn TTFT: ``--conversations`` chats of ``--turns`` turns served one request
  at a time, round robin, each turn adding 64 user tokens to the chat so far and
  generating 16. The pool holds about one chat, so a chat's previous turns have left
  it when it comes back: with the CPU and SSD tiers they are loaded, without them they
  are recomputed. TTFT is admission to first token (the load included); the figure
  is the ratio of the mean over later turns, with the tiers / without. Outputs of the
  two runs must be identical;
* FP8: greedy tokens of ``fp8_e4m3`` / ``fp8_e5m2`` caches (scale 1, and scales
  calibrated to the largest K and V the full-precision cache held) against the
  full-precision cache: the tokens that agree before the first divergence, and the
  largest error of the first token's logits. On two models: the tiny Llama trained
  for a few seconds to copy a repeated segment (confident tokens that depend on
  attention, as a trained model's are), and the random-weight model above, whose
  8 random layers amplify any perturbation (an upper bound, not an estimate for a
  trained model).

    .venv/bin/python benchmarks/bench_engine.py [--device cpu|cuda] [--json PATH]
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

from engine_util import build_engine_model, engine_config, random_prompt  # noqa: E402

MODEL = {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 2, "intermediate": 1536}


def open_engine(model: Path, tmp: Path, device: str, **kw: Any) -> Any:
    from kvstrata.engine import LLMEngine

    opts = {k: kw.pop(k) for k in ("kv_cache_dtype", "k_scale", "v_scale") if k in kw}
    return LLMEngine(model, engine_config(tmp, device=device, **kw), **opts)


def throughput(model: Path, tmp: Path, args: argparse.Namespace) -> dict[str, float]:
    prompts = [random_prompt(args.prompt_tokens, 1000 + i) for i in range(args.batch)]
    with open_engine(model, tmp / "throughput", args.device, ssd=None, gpu_blocks=args.gpu_blocks) as eng:
        eng.generate([random_prompt(32, 1)], 2)  # warm-up
        before = eng.stats()
        eng.generate(prompts, args.decode_steps + 1)
        after = eng.stats()
    prefill_s = after["prefill_seconds"] - before["prefill_seconds"]
    decode_s = after["decode_seconds"] - before["decode_seconds"]
    decoded = args.batch * args.decode_steps
    return {"prefill_tokens": args.batch * args.prompt_tokens, "prefill_s": prefill_s,
            "prefill_tok_s": args.batch * args.prompt_tokens / prefill_s,
            "decode_tokens": decoded, "decode_s": decode_s, "decode_tok_s": decoded / decode_s,
            "decode_batch": args.batch}


def multi_turn(model: Path, tmp: Path, args: argparse.Namespace, tiers: bool) -> dict[str, Any]:
    blocks = (256 + args.turns * 80) // 16 + 8  # about one chat
    kw = {"gpu_blocks": blocks, "cpu": "256MiB", "ssd": "1GiB"} if tiers else \
         {"gpu_blocks": blocks, "cpu": "0", "ssd": None}
    chats = [random_prompt(256, 2000 + c) for c in range(args.conversations)]
    ttft: list[list[float]] = [[] for _ in range(args.turns)]
    outputs: list[list[int]] = []
    served = {"gpu": 0, "cpu": 0, "ssd": 0, "computed": 0}
    (tmp / f"chat-{tiers}").mkdir()
    with open_engine(model, tmp / f"chat-{tiers}", args.device, **kw) as eng:
        eng.generate([random_prompt(32, 1)], 2)  # warm-up
        for turn in range(args.turns):
            for c in range(args.conversations):
                chats[c] = chats[c] + random_prompt(64, 3000 + 100 * c + turn)
                out = eng.run([chats[c]], 16)[0]
                ttft[turn].append(out.ttft_s)
                outputs.append(out.samples[0])
                chats[c] = chats[c] + out.samples[0]
                if turn:
                    for t, n in out.hit_tokens.items():
                        served[t] = served.get(t, 0) + n
                    served["computed"] += out.computed_tokens
    later = [t for turn in ttft[1:] for t in turn]
    return {"ttft_first_turn_s": statistics.mean(ttft[0]), "ttft_later_turns_s": statistics.mean(later),
            "later_turns_served_tokens": served, "outputs": outputs}


def copy_prompt(length: int, seed: int, segment: int = 24) -> list[int]:
    """A random ``segment`` of ids repeated to ``length``: after the first repeat every token
    is predictable only by attending ``segment`` tokens back (an induction head's task)."""
    seg = random_prompt(segment, seed)
    return (seg * (length // segment + 1))[:length]


def train_copy_model(path: Path, steps: int) -> Path:
    """The tiny Llama (2 layers, init 0.02) trained on :func:`copy_prompt` sequences until
    it copies: a model whose greedy tokens are confident and depend on attention."""
    import torch
    from transformers import AutoModelForCausalLM

    src = build_engine_model(path.parent / "copy-init", init_range=0.02, seed=3)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for step in range(steps):
        x = torch.tensor([copy_prompt(128, 10_000 * step + b) for b in range(16)])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(path, safe_serialization=True)
    return path


def fp8_accuracy(model: Path, tmp: Path, args: argparse.Namespace, prompts: list[list[int]],
                 label: str) -> list[dict[str, Any]]:
    (tmp / "fp8").mkdir(exist_ok=True)
    with open_engine(model, tmp / "fp8", args.device, ssd=None) as eng:
        ref = eng.run(prompts, args.fp8_tokens, return_logits=True)
        k_max = max(float(c.abs().max()) for c in eng.kv.key_caches)
        v_max = max(float(c.abs().max()) for c in eng.kv.value_caches)
    rows = []
    for kv, fp8_max in (("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)):
        for scales, ks, vs in (("1", 1.0, 1.0), ("calibrated", k_max / fp8_max, v_max / fp8_max)):
            with open_engine(model, tmp / "fp8", args.device, ssd=None, kv_cache_dtype=kv, k_scale=ks,
                             v_scale=vs) as eng:
                outs = eng.run(prompts, args.fp8_tokens, return_logits=True)
            agree = sum(agreeing(o.samples[0], r.samples[0]) for o, r in zip(outs, ref))
            err = max(float((o.logits[0] - r.logits[0]).abs().max()) for o, r in zip(outs, ref))
            spread = statistics.mean(float(r.logits[0].std()) for r in ref)
            rows.append({"model": label, "kv_cache_dtype": kv, "scales": scales, "k_scale": ks, "v_scale": vs,
                         "tokens_agreeing": agree, "tokens": sum(len(r.samples[0]) for r in ref),
                         "first_token_agrees": sum(o.samples[0][0] == r.samples[0][0] for o, r in zip(outs, ref)),
                         "prompts": len(prompts), "max_logit_error": err, "logit_std": spread})
    return rows


def agreeing(got: list[int], want: list[int]) -> int:
    """Leading tokens of ``got`` equal to ``want``'s (greedy decoding diverges for good after one)."""
    n = 0
    while n < min(len(got), len(want)) and got[n] == want[n]:
        n += 1
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--gpu-blocks", type=int, default=512)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--fp8-tokens", type=int, default=16)
    p.add_argument("--train-steps", type=int, default=150, help="training steps of the FP8 model (default: 150)")
    p.add_argument("--skip-fp8", action="store_true")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    import torch

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-engine-") as d:
        tmp = Path(d)
        model = build_engine_model(tmp / "model", **MODEL)
        t0 = time.perf_counter()
        result: dict[str, Any] = {"device": args.device, "model": MODEL, "threads": torch.get_num_threads()}
        result["throughput"] = throughput(model, tmp, args)
        with_tiers = multi_turn(model, tmp, args, tiers=True)
        without = multi_turn(model, tmp, args, tiers=False)
        if with_tiers.pop("outputs") != without.pop("outputs"):
            print("FAILED: outputs differ with and without the tiers", file=sys.stderr)
            return 1
        result["multi_turn"] = {"with_tiers": with_tiers, "without_tiers": without,
                                "ttft_ratio": with_tiers["ttft_later_turns_s"] / without["ttft_later_turns_s"]}
        if not args.skip_fp8:
            copier = train_copy_model(tmp / "copy-model", args.train_steps)
            result["fp8"] = [
                *fp8_accuracy(copier, tmp, args, [copy_prompt(n, 4000 + i) for i, n in enumerate((40, 64, 88, 100))],
                              f"trained to copy ({args.train_steps} steps)"),
                *fp8_accuracy(model, tmp, args, [random_prompt(n, 4000 + i) for i, n in enumerate((100, 200, 300, 400))],
                              "random weights")]
        result["seconds"] = time.perf_counter() - t0
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def render(r: dict[str, Any]) -> str:
    t, m = r["throughput"], r["multi_turn"]
    w, wo = m["with_tiers"], m["without_tiers"]
    lines = [f"device {r['device']}, {r['threads']} torch threads, model {r['model']}", "",
             "| measure | value |", "|---|---|",
             f"| prefill ({t['prefill_tokens']} tokens in one batch) | {t['prefill_tok_s']:,.0f} tokens/s |",
             f"| decode (batch {t['decode_batch']}, {t['decode_tokens']} tokens) | {t['decode_tok_s']:,.0f} tokens/s |",
             f"| TTFT, later turns, with CPU + SSD tiers | {w['ttft_later_turns_s'] * 1e3:.1f} ms "
             f"(served: {w['later_turns_served_tokens']}) |",
             f"| TTFT, later turns, pool only | {wo['ttft_later_turns_s'] * 1e3:.1f} ms "
             f"(served: {wo['later_turns_served_tokens']}) |",
             f"| **TTFT ratio, with tiers / without** | **{m['ttft_ratio']:.2f}x** |"]
    if "fp8" in r:
        lines += ["", "| model | KV cache | scales | greedy tokens agreeing (until the first divergence) | "
                  "first token agrees | largest first-token logit error (logit std) |", "|---|---|---|---|---|---|"]
        for f in r["fp8"]:
            lines.append(f"| {f['model']} | {f['kv_cache_dtype']} | {f['scales']} | {f['tokens_agreeing']}/{f['tokens']} | "
                         f"{f['first_token_agrees']}/{f['prompts']} | {f['max_logit_error']:.3f} "
                         f"({f['logit_std']:.2f}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
