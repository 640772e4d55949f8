"""``kvstrata generate``: greedy generation through :mod:`kvstrata.engine`, and where each
prompt's prefix came from. Every prompt is checked before the weights load.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvstrata.config.schema import plural
from kvstrata.system.files import write_json

__all__ = ["cmd_generate"]


def cmd_generate(args: argparse.Namespace) -> int:
    """Greedy generation through kvstrata.engine; prints each prompt's samples and where its
    prefix came from."""
    from kvstrata.config.schema import KVStrataConfig
    from kvstrata.engine import LLMEngine
    from kvstrata.engine.engine import EnginePlan
    from kvstrata.engine.prompts import load_tokenizer, read_prompts

    prompts = read_prompts(args.prompt_file, args.model)
    overrides = list(args.set or [])
    config = KVStrataConfig.from_yaml(args.config, overrides) if args.config else KVStrataConfig.from_dict({}, overrides)
    plan = EnginePlan.of(args.model, config, kv_cache_dtype=args.kv_cache_dtype)
    for i, prompt in enumerate(prompts):  # every prompt, before the weights load or a tier opens
        plan.check(prompt, args.max_new_tokens, args.n, f"prompts[{i}]")
    with LLMEngine(args.model, config, kv_cache_dtype=args.kv_cache_dtype, k_scale=args.k_scale,
                   v_scale=args.v_scale) as engine:
        t0 = time.perf_counter()
        outputs = engine.run(prompts, args.max_new_tokens, n=args.n)
        seconds = time.perf_counter() - t0
        stats = engine.stats()
    tokenizer = load_tokenizer(args.model) if not args.quiet and args.json != "-" else None
    if args.json:
        write_json(args.json, {"outputs": [_generate_record(o) for o in outputs], "seconds": seconds,
                                "stats": {k: v for k, v in stats.items() if k != "cache"}})
    if not args.quiet and args.json != "-":
        for i, out in enumerate(outputs):
            print(f"prompt {i}: {plural(out.prompt_tokens, 'token')}; prefix: {_sources(out)}")
            for j, sample in enumerate(out.samples):
                print(f"  sample {j}: {' '.join(map(str, sample))}")
                if tokenizer is not None:
                    print(f"    {tokenizer.decode(sample)!r}")
        tokens = stats["generated_tokens"]
        print(f"{plural(tokens, 'token')} generated in {seconds:.2f} s; {plural(stats['cow_copies'], 'block')} "
              f"copied on write")
    return 0


def _sources(out: Any) -> str:
    """``32 GPU pool, 16 CPU, 0 SSD, 9 computed``."""
    from kvstrata.policy.tiers import GPU, KNOWN

    names = {GPU: "GPU pool", **{name: t.label for name, t in KNOWN.items()}}
    parts = [f"{out.hit_tokens.get(t, 0)} {name}" for t, name in names.items() if t in out.hit_tokens]
    return ", ".join([*parts, f"{out.computed_tokens} computed"])


def _generate_record(out: Any) -> dict[str, Any]:
    return {"prompt_tokens": out.prompt_tokens, "samples": out.samples, "hit_tokens": out.hit_tokens,
            "computed_tokens": out.computed_tokens, "ttft_s": out.ttft_s}
