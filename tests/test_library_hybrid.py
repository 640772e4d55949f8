"""The library (``TieredKVCache``) serves a hybrid model through the one device-pool protocol:
a full-attention group beside a sliding window (and a chunked-attention group), a block table
per group over one pool of rows (row 0 the null block), as vLLM's hybrid allocator keeps them.

Loads come back byte-exact from the DRAM tier, from the SSD tier and after a restart, each
group's rows where the hit needs them and the null row where the window skips; and the bench
replay, fed the same prompts, predicts the library's hits per tier and the policy's decisions
(blocks stored, promoted, evicted, dropped per tier) exactly. A real LMDB on disk; the device
pool is a CPU tensor (no GPU here), which is what the library allocates on a CPU device.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from kvstrata import KVStrataConfig, TieredKVCache
from kvstrata.bench.replay import ReplayOptions, replay
from kvstrata.trace.reader import load_trace

BS = 16
WINDOW = 3 * BS  # a hit at n needs the window's blocks from (16n - 47) // 16 on
GROUPS = {"plain": None, "sliding": f"full,sliding:{WINDOW}", "sliding-chunked": f"full,sliding:{WINDOW},chunked:64"}


def config(tmp_path: Path, rows: int, cpu_blocks: int, ssd: str = "4MiB", groups: str | None = GROUPS["sliding"],
           **extra: Any) -> dict[str, Any]:
    model: dict[str, Any] = {"name": "tiny-hybrid", "layers": 2, "kv_heads": 2, "head_size": 16,
                             "kv_dtype": "float16"}  # 4 KiB a block
    if groups:
        model["groups"] = groups
    return {"model": model, "block_size": BS, "gpu": {"num_blocks": rows, "device": "cpu"},
            "cpu": {"capacity": cpu_blocks * 4096}, "ssd": {"path": str(tmp_path / "ssd"), "capacity": ssd}, **extra}


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 30000) for _ in range(n)]


def fill(cache: TieredKVCache, tables: list[list[int]], lo: int, seed: int) -> dict[tuple[int, int], int]:
    """Writes a byte of its own into every row of every group from position ``lo``; returns them."""
    out = {}
    for g, table in enumerate(tables):
        for i in range(lo, len(table)):
            if table[i]:
                value = (seed * 41 + g * 31 + i * 7 + 1) % 255 + 1
                cache.kv_pool[table[i]].fill_(value)
                out[(g, i)] = value
    return out


def check_loaded(cache: TieredKVCache, tables: list[list[int]], hit: int, written: dict[tuple[int, int], int]) -> int:
    """Every row the hit needs holds the bytes written under its group and position; the
    window's skipped positions are the null row. Returns the rows compared."""
    needed = {g: cache.groups.needed_from(g, hit) for g in range(len(tables))}
    compared = 0
    for g, table in enumerate(tables):
        for i in range(hit):
            row = table[i]
            if i < needed[g] or (g, i) not in written:
                continue
            assert row != 0, f"group {g} position {i}: the hit needs it, the table has the null row"
            assert bool((cache.kv_pool[row] == written[(g, i)]).all()), f"group {g} position {i}: other bytes"
            compared += 1
        assert all(table[i] == 0 for i in range(min(needed[g], hit)) if cache.groups.groups[g].kind != "full")
    return compared


def test_a_hybrid_prefix_comes_back_byte_exact_from_dram_ssd_and_after_a_restart(tmp_path: Path) -> None:
    rng = random.Random(3)
    prompt = tokens(rng, 6 * BS + 3)  # six full blocks: a hit of six needs the window's blocks 3..5
    cfg = KVStrataConfig.from_dict(config(tmp_path, rows=20, cpu_blocks=16, spill={"admission": "on_evict"}))
    cache = TieredKVCache(cfg)
    assert len(cache.groups) == 2
    first = cache.allocate("a", prompt)
    assert first.num_cached_tokens == 0 and len(first.block_ids) == 2
    written = fill(cache, first.block_ids, 0, seed=1)
    cache.commit("a")
    cache.free("a")
    other = cache.allocate("x", tokens(rng, 8 * BS + 1))  # takes the pool's free rows: A's go to DRAM
    fill(cache, other.block_ids, 0, seed=2)
    cache.commit("x")
    cache.free("x")

    again = cache.allocate("a2", prompt)
    assert again.num_cached_tokens == 6 * BS and again.hit_blocks["cpu"] == 6, again.hit_blocks
    assert check_loaded(cache, again.block_ids, 6, written) == 6 + 3  # six full-attention rows, three window rows
    cache.commit("a2")
    cache.free("a2")
    cache.close()  # the hot set the SSD tier lacks is stored: a restart serves it

    restarted = TieredKVCache(KVStrataConfig.from_dict(config(tmp_path, rows=20, cpu_blocks=16)))
    assert restarted.wait_ready(30)
    back = restarted.allocate("a3", prompt)
    assert back.hit_blocks["ssd"] == 6 and back.num_cached_tokens == 6 * BS, back.hit_blocks
    assert check_loaded(restarted, back.block_ids, 6, written) == 9
    stats = restarted.stats()
    assert stats["hits"]["ssd"]["blocks"] == 6
    restarted.close()


def test_a_window_block_missing_below_makes_the_hit_shorter_never_partial(tmp_path: Path) -> None:
    """A hit is the longest prefix every group can serve: with the window's blocks of the
    prompt's end gone from every tier, the prompt's own end is no hit; nothing is loaded
    that attention could not use."""
    rng = random.Random(4)
    prompt = tokens(rng, 6 * BS + 3)
    cache = TieredKVCache(KVStrataConfig.from_dict(config(tmp_path, rows=20, cpu_blocks=16,
                                                          spill={"admission": "on_evict"})))
    a = cache.allocate("a", prompt)
    fill(cache, a.block_ids, 0, seed=5)
    cache.commit("a")
    cache.free("a")
    window_keys = [_state(cache, prompt).group_key(1, i) for i in range(3, 6)]
    cache.manager.free_window(0)
    for row, key in cache.manager.resident():  # the device forgets A's window rows, the tiers below never had them
        if key in window_keys:
            cache.manager.evict_cached(cache.manager.blocks[row])
    assert not any(cache.policy.holds(k) for k in window_keys)
    b = cache.allocate("b", prompt)
    assert b.num_cached_tokens == 0 and sum(b.hit_blocks.values()) == 0, b.hit_blocks
    cache.free("b")
    cache.close()


def _state(cache: TieredKVCache, prompt: list[int]) -> Any:
    from kvstrata.core.request import RequestState
    from kvstrata.pool.blocks import make_prompt

    return RequestState("probe", make_prompt(cache.hasher, prompt).hashes)


def chat(users: int, turns: int, seed: int) -> list[list[int]]:
    """Multi-turn chat over two system prompts: each turn extends its user's conversation."""
    rng = random.Random(seed)
    systems = [tokens(rng, 5 * BS) for _ in range(2)]
    convo = {u: list(systems[u % 2]) for u in range(users)}
    out = []
    for _ in range(users * turns):
        u = rng.randrange(users)
        convo[u] += tokens(rng, rng.randint(10, 60))
        out.append(list(convo[u]))
        if len(convo[u]) > 30 * BS:
            convo[u] = list(systems[u % 2])
    return out


def serve(cache: TieredKVCache, prompts: list[list[int]], tiers: tuple[str, ...]) -> dict[str, int]:
    """Each prompt allocated, committed and freed in turn; the blocks each of ``tiers`` served."""
    hits = dict.fromkeys(tiers, 0)
    for i, prompt in enumerate(prompts):
        alloc = cache.allocate(f"r{i}", prompt)
        for t in hits:
            hits[t] += alloc.hit_blocks.get(t, 0)
        cache.commit(f"r{i}")
        cache.free(f"r{i}")
    return hits


COUNTS = (("stored", "spills"), ("promoted", "promotions"), ("evicted", "evictions"), ("dropped", "dropped_spills"))


@pytest.mark.parametrize("groups,admission", [("plain", "on_compute"), ("sliding", "on_compute"),
                                              ("sliding", "on_evict"), ("sliding-chunked", "on_compute"),
                                              ("sliding-chunked", "on_evict")])
def test_the_replay_predicts_the_librarys_hits_and_decisions(tmp_path: Path, groups: str, admission: str) -> None:
    """Requests one at a time (each freed before the next). A plain model under ``on_evict``
    is left out: the replay allocates a load's blocks a step before the rest, as vLLM's
    scheduler does, and the library allocates a request's blocks in one call, so under
    ``on_evict`` the blocks it evicts are offered in another order."""
    prompts = chat(10, 8, seed=7)
    rows = 60 if GROUPS[groups] is None else 120
    settings = config(tmp_path, rows=rows, cpu_blocks=60, ssd="3MiB", groups=GROUPS[groups],
                      spill={"admission": admission, "write_through": False})
    cache = TieredKVCache(KVStrataConfig.from_dict(settings))
    hits = serve(cache, prompts, ("gpu", "cpu", "ssd"))
    stats = cache.stats()
    cache.close()

    trace_path = tmp_path / "trace.jsonl"
    with open(trace_path, "w") as fh:
        for i, prompt in enumerate(prompts):
            fh.write(json.dumps({"timestamp": i, "token_ids": prompt, "output_length": 1}) + "\n")
    # the replay's gpu.num_blocks is what the pool hands out: the grouped pool's null row is extra
    usable = rows if GROUPS[groups] is None else rows - 1
    replay_settings = {**settings, "gpu": {"num_blocks": usable}, "ssd": {**settings["ssd"],
                                                                          "path": str(tmp_path / "unused")}}
    result = replay(load_trace(trace_path, block_size=BS), KVStrataConfig.from_dict(replay_settings),
                    ReplayOptions(decode_s_per_token=0.0))
    assert result.rejected == 0 and result.forced_frees == 0
    assert result.hit_blocks == hits
    for name, key in COUNTS:
        assert {t: result.stats[key][t] for t in ("cpu", "ssd")} == {t: stats[key][t] for t in ("cpu", "ssd")}, name
    assert hits["gpu"] > 0 and hits["cpu"] > 0 and hits["ssd"] > 0, hits  # every tier served


def test_a_state_group_is_refused_naming_the_key(tmp_path: Path) -> None:
    from kvstrata.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model\.groups: 'full,state'.*state group"):
        TieredKVCache(KVStrataConfig.from_dict(config(tmp_path, rows=20, cpu_blocks=4, groups="full,state")))
    assert not (tmp_path / "ssd").exists()  # refused before any tier was opened
