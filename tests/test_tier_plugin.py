"""A tier kind defined in one file under tests/ (``dict_tier.py``: a dict between DRAM and SSD)
runs through the library and the bench replay: blocks cascade DRAM -> dict -> SSD, hits come
back byte-exact from each tier, the replay predicts the library's hits and decisions per tier,
block for block, and the tier shows under its declared name in the statistics. A real LMDB on
disk; the device pool is a CPU tensor."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from dict_tier import OPENED, dict_tier  # noqa: E402
from test_library_hybrid import COUNTS, GROUPS, chat, check_loaded, config, fill, serve, tokens  # noqa: E402

from kvstrata import KVStrataConfig, TieredKVCache  # noqa: E402
from kvstrata.bench.replay import ReplayOptions, replay  # noqa: E402
from kvstrata.trace.reader import load_trace  # noqa: E402

BS = 16
TIERS = ("cpu", "dict", "ssd")


@pytest.mark.parametrize("groups,write_through", [(None, False), (GROUPS["sliding"], False), (None, True)])
def test_the_dict_tier_serves_between_dram_and_ssd_and_the_replay_predicts_it(tmp_path: Path, groups: str | None,
                                                                             write_through: bool) -> None:
    """Admission ``on_compute`` (under ``on_evict`` the replay offers a request's evictions step by
    step and the library in one batch, which reorders a small tier's LRU order: with the
    built-in tiers alone as well). Without write-through, DRAM evictions cascade into the dict
    tier and its own into the SSD tier; with it, every block also goes to the SSD tier and the
    dict tier takes DRAM's evictions."""
    prompts = chat(10, 8, seed=7)
    rows = 60 if groups is None else 120
    settings = config(tmp_path, rows=rows, cpu_blocks=20, ssd="3MiB", groups=groups,
                      spill={"admission": "on_compute", "write_through": write_through})
    with dict_tier(30):
        cache = TieredKVCache(KVStrataConfig.from_dict(settings))
        assert cache.policy.chain == TIERS
        hits = serve(cache, prompts, ("gpu", *TIERS))
        stats = cache.stats()
        cascades = [t.cascade for t in cache.policy.spec.tiers.local]
        assert cascades == (["dict", None, None] if write_through else ["dict", "ssd", None])
        # the dict tier's backend holds exactly what the policy says it holds
        held = {k for k in cache.policy.holdings.indexes["dict"] if not k.startswith(b"\x00")}
        assert set(OPENED[0].data) == held and held
        cache.close()

        trace_path = tmp_path / "trace.jsonl"
        with open(trace_path, "w") as fh:
            for i, prompt in enumerate(prompts):
                fh.write(json.dumps({"timestamp": i, "token_ids": prompt, "output_length": 1}) + "\n")
        replay_settings = {**settings, "gpu": {"num_blocks": rows if groups is None else rows - 1},
                           "ssd": {**settings["ssd"], "path": str(tmp_path / "unused")}}
        result = replay(load_trace(trace_path, block_size=BS), KVStrataConfig.from_dict(replay_settings),
                        ReplayOptions(decode_s_per_token=0.0))
    assert result.hit_blocks == hits
    for name, key in COUNTS:
        assert {t: result.stats[key][t] for t in TIERS} == {t: stats[key][t] for t in TIERS}, name
    assert all(hits[t] > 0 for t in ("gpu", *TIERS)), hits  # every tier served


def test_a_prefix_comes_back_byte_exact_from_the_dict_tier(tmp_path: Path) -> None:
    """A prefix evicted from the GPU pool and then from DRAM lands in the dict tier (its DRAM
    evictions cascade there) and is loaded back from it, every row the bytes written."""
    rng = random.Random(5)
    prompt = tokens(rng, 6 * BS + 3)
    settings = config(tmp_path, rows=20, cpu_blocks=4, groups=None,
                      spill={"admission": "on_evict", "write_through": False})
    with dict_tier(16):
        cache = TieredKVCache(KVStrataConfig.from_dict(settings))
        first = cache.allocate("a", prompt)
        written = fill(cache, [first.block_ids], 0, seed=1)  # a plain model: one group
        cache.commit("a")
        cache.free("a")
        for n in range(3):  # other prompts take the pool's rows, then DRAM's slots: A goes down
            other = cache.allocate(f"x{n}", tokens(rng, 8 * BS + 1))
            fill(cache, [other.block_ids], 0, seed=2 + n)
            cache.commit(f"x{n}")
            cache.free(f"x{n}")
        again = cache.allocate("a2", prompt)
        hits = again.hit_blocks
        assert hits["dict"] >= 5 and hits["cpu"] + hits["dict"] == 6 and again.num_cached_tokens == 6 * BS, hits
        assert check_loaded(cache, [again.block_ids], 6, written) == len([i for _, i in written if i < 6]) >= 5
        stats = cache.stats()
        assert stats["hits"]["dict"]["blocks"] == stats["executor"]["blocks_loaded_dict"] == hits["dict"]
        assert stats["occupancy"]["dict"] > 0 and stats["capacity_blocks"]["dict"] == 16
        cache.close()
