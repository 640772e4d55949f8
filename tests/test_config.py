from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvstrata import ConfigError
from kvstrata.config.schema import KVStrataConfig, apply_overrides, parse_size, short_repr

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text,expected", [
    ("512MiB", 512 * 2**20), ("64GiB", 64 * 2**30), ("1.5GiB", 3 * 2**29), (4096, 4096),
    ("100", 100), ("2 TiB", 2 * 2**40), ("1GB", 10**9), ("0", 0),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "-5", "5 parsecs", "", None, True, -1, [1]])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError, match="cpu.capacity: expected"):
        parse_size(bad, "cpu.capacity")


@pytest.mark.parametrize("text,expected", [
    ("1048576TiB", 2**60), ("9007199254740993", 2**53 + 1), ("0.5B", 0), ("0.1KB", 100),
    ("1.000000000001TiB", 2**40 + 1), (1.5 * 2**30, 3 * 2**29), (2.0**60, 2**60),
])
def test_parse_size_is_exact_up_to_one_eib(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", [
    float("inf"), float("-inf"), float("nan"), 1e300, 2**60 + 1, 10**5000, "1048577TiB", "9" * 400 + "GiB",
], ids=["inf", "-inf", "nan", "1e300", "2**60+1", "10**5000", "1048577TiB", "400 digits GiB"])
def test_parse_size_rejects_non_finite_and_huge(bad):
    with pytest.raises(ConfigError, match=r"^cpu\.capacity: expected a finite size between 0 and 1 EiB, got ") as e:
        parse_size(bad, "cpu.capacity")
    assert len(str(e.value)) < 150


@pytest.mark.parametrize("key,value,expected", [
    ("cpu.capacity", 1e300, "expected a finite size between 0 and 1 EiB, got 1e+300"),
    ("ssd.capacity", float("inf"), "expected a finite size between 0 and 1 EiB, got inf"),
    ("ssd.queue_capacity", float("nan"), "expected a finite size between 0 and 1 EiB, got nan"),
    ("gpu.capacity", -1e300, "expected a non-negative size, got -1e+300"),
    ("model.block_nbytes", 10**30, "expected a finite size between 0 and 1 EiB, got 1000000000000000000000000000000"),
    ("block_size", 10**30, "must be <= 2147483647, got 1000000000000000000000000000000"),
    ("gpu.num_blocks", 2**31, "must be <= 2147483647, got 2147483648"),
    ("gpu.max_num_batched_tokens", 0, "must be >= 1, got 0"),
    ("gpu.max_num_batched_tokens", 1e300, "expected an integer, got 1e+300"),
    ("model.layers", 1e300, "expected an integer, got 1e+300"),
    ("ssd.level", 10**30, "must be <= 22, got 1000000000000000000000000000000"),
    ("metrics.port", 70000, "must be <= 65535, got 70000"),
    ("spill.watermark", float("nan"), "expected a fraction between 0 and 1, got nan"),
    ("spill.watermark", float("inf"), "expected a fraction between 0 and 1, got inf"),
])
def test_numeric_fields_reject_huge_and_non_finite_values(key, value, expected):
    overrides = {key: value, **({"spill.admission": "on_evict"} if key == "spill.watermark" else {})}
    with pytest.raises(ConfigError, match=f"^{re.escape(key)}: {re.escape(expected)}$"):
        KVStrataConfig.from_dict({}, overrides)


def _bomb(levels: int) -> list:
    """A "billion laughs" list: ``9 ** (levels + 1)`` strings through shared references."""
    value: list = ["lol"] * 9
    for _ in range(levels):
        value = [value] * 9
    return value


def test_short_repr_is_short_and_cheap_for_any_value():
    loop: list = [1]
    loop.append(loop)
    for value in ("x" * 100_000, 10**5000, -(10**5000), _bomb(12), {str(i): i for i in range(10_000)}, loop,
                  b"y" * 100_000):
        text = short_repr(value)
        assert len(text) <= 80 and ("..." in text or "integer of" in text), text
    assert short_repr("lots") == "'lots'" and short_repr(1.5) == "1.5" and short_repr([1, None]) == "[1, None]"


@pytest.mark.parametrize("key,value", [
    ("cpu.capacity", "x" * 100_000), ("cpu.capacity", _bomb(12)), ("cpu.capacity", 10**5000),
    ("gpu.capacity", list(range(100_000))), ("gpu.device", "cuda" * 10_000), ("gpu.num_blocks", "9" * 10_000),
    ("ssd.path", ["p"] * 100_000), ("ssd.compression", "z" * 100_000), ("ssd.level", -(10**5000)),
    ("model.name", {"k": "v" * 100_000}), ("model.id", 7 * ["i" * 10_000]), ("model.kv_dtype", "f" * 10_000),
    ("spill.watermark", "w" * 100_000), ("spill.write_through", "t" * 100_000),
    ("spill.admission", "a" * 100_000), ("spill.promotion", _bomb(12)), ("hash", "h" * 100_000),
    ("metrics.port", 10**5000), ("cpu.pin_memory", "p" * 100_000), ("block_size", "b" * 100_000),
], ids=lambda v: v if isinstance(v, str) and len(v) < 40 else type(v).__name__)
def test_error_messages_never_print_a_whole_value(key, value):
    with pytest.raises(ConfigError, match=f"^{re.escape(key)}: ") as e:
        KVStrataConfig.from_dict({}, {key: value})
    assert len(str(e.value)) < 200, str(e.value)[:300]


def test_error_messages_shorten_long_keys_and_overrides():
    for data, overrides in [({"cpu": {"k" * 100_000: 1}}, ()), ({"k" * 100_000: 1}, ()),
                            ({}, ["cpu.capacity=" + "x" * 100_000]), ({}, ["x" * 100_000]),
                            ({}, ["cpu." + "." * 100_000 + "=1"]), ({}, {"cpu.capacity." + "c" * 100_000: 1})]:
        with pytest.raises(ConfigError) as e:
            KVStrataConfig.from_dict(data, overrides)
        assert len(str(e.value)) < 200, str(e.value)[:300]


def test_every_shipped_config_loads():
    files = sorted((ROOT / "configs").glob("*.yaml"))
    names = {f.name for f in files}
    assert {"default.yaml", "chat-8b-48gb.yaml", "rag-70b-fp8-4x80gb.yaml", "longdoc-32b-2x80gb.yaml"} <= names
    for f in files:
        cfg = KVStrataConfig.from_yaml(f)
        assert cfg.block_nbytes() > 0
        assert cfg.gpu.resolve_num_blocks(cfg.block_nbytes()) >= 1


def test_default_yaml_matches_documented_shape():
    cfg = KVStrataConfig.from_yaml(ROOT / "configs" / "default.yaml")
    assert cfg.block_size == 16 and cfg.hash == "sha256"
    assert cfg.gpu.num_blocks == 1024 and cfg.gpu.device == "auto"
    assert cfg.cpu.capacity == 8 * 2**30 and cfg.cpu.pin is None
    assert cfg.ssd.capacity == 100 * 2**30 and cfg.ssd.compression == "auto" and cfg.ssd.level == 1
    assert cfg.metrics.port is None
    # Llama-3-8B fp16: 128 KiB per token, 2 MiB per 16-token block (seed 3.1)
    assert cfg.model.bytes_per_token() == 131072
    assert cfg.block_nbytes() == 2 * 2**20


def test_scenario_fp8_halves_bytes_per_token():
    rag = KVStrataConfig.from_yaml(ROOT / "configs" / "rag-70b-fp8-4x80gb.yaml")
    assert rag.model.kv_dtype == "fp8"
    assert rag.model.bytes_per_token() == 2 * 80 * 2 * 128 * 1
    assert rag.gpu.resolve_num_blocks(rag.block_nbytes()) == 50 * 2**30 // rag.block_nbytes()


def test_admission_rules_reject_what_a_mode_cannot_honour():
    cfg = KVStrataConfig.from_dict({})
    assert cfg.spill.admission == "on_compute"
    with pytest.raises(ConfigError, match=r"^spill.promotion: exclusive needs spill.admission: on_evict"):
        KVStrataConfig.from_dict({"spill": {"promotion": "exclusive"}})
    with pytest.raises(ConfigError, match=r"^spill.watermark: only used with spill.admission: on_evict"):
        KVStrataConfig.from_dict({"spill": {"watermark": 0.05}})
    ok = KVStrataConfig.from_dict({"spill": {"admission": "on_evict", "watermark": 0.05, "promotion": "exclusive"}})
    assert ok.spill.watermark == 0.05 and ok.explicit >= {"spill.admission", "spill.watermark"}
    with pytest.raises(ConfigError, match=r"^spill.admission: expected one of on_compute, on_evict"):
        KVStrataConfig.from_dict({"spill": {"admission": "lazy"}})


def test_reject_names_only_explicit_keys():
    cfg = KVStrataConfig.from_dict({"gpu": {"device": "cpu"}})
    cfg.reject(("block_size", "cpu"), "never")  # not set: nothing raised
    with pytest.raises(ConfigError, match=r"^gpu.device: vLLM sizes"):
        cfg.reject(("gpu",), "vLLM sizes its pool")


def test_bad_value_names_field_path():
    with pytest.raises(ConfigError, match=r"^cpu.capacity: expected a size like '8GiB', got 'lots'"):
        KVStrataConfig.from_dict({"cpu": {"capacity": "lots"}})
    with pytest.raises(ConfigError, match=r"^ssd.compression: expected one of"):
        KVStrataConfig.from_dict({"ssd": {"compression": "lz4"}})
    with pytest.raises(ConfigError, match=r"^hash: expected one of"):
        KVStrataConfig.from_dict({"hash": "md5"})
    with pytest.raises(ConfigError, match=r"^block_size: must be >= 1"):
        KVStrataConfig.from_dict({"block_size": 0})
    with pytest.raises(ConfigError, match=r"^gpu: set either num_blocks or capacity"):
        KVStrataConfig.from_dict({"gpu": {"num_blocks": 4, "capacity": "1GiB"}})


def test_unknown_keys_get_did_you_mean():
    with pytest.raises(ConfigError, match=r"^cpu.capacty: unknown key; did you mean 'capacity'\?"):
        KVStrataConfig.from_dict({"cpu": {"capacty": "1GiB"}})
    with pytest.raises(ConfigError, match=r"^metric: unknown key; did you mean 'metrics'\?"):
        KVStrataConfig.from_dict({"metric": {}})


def test_dotted_overrides_apply_on_top_of_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("cpu: {capacity: 1GiB}\nssd: {path: /tmp/x}\n")
    cfg = KVStrataConfig.from_yaml(f, ["cpu.capacity=16GiB", "ssd.level=3", "gpu.num_blocks=8"])
    assert cfg.cpu.capacity == 16 * 2**30
    assert cfg.ssd.level == 3 and cfg.ssd.path == "/tmp/x"
    assert cfg.gpu.num_blocks == 8
    cfg2 = KVStrataConfig.from_dict({}, {"ssd.path": None, "cpu.capacity": "2GiB"})
    assert not cfg2.ssd.enabled and cfg2.cpu.capacity == 2 * 2**30
    with pytest.raises(ConfigError, match=r"^cpu.capasity: unknown key; did you mean 'capacity'"):
        KVStrataConfig.from_dict({}, ["cpu.capasity=1GiB"])
    with pytest.raises(ConfigError, match=r"^spil: unknown key; did you mean 'spill'"):
        apply_overrides({}, {"spil.watermark": 0.1})
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        KVStrataConfig.from_dict({}, ["cpu.capacity"])


def test_yaml_errors_name_file_and_line(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("cpu:\n  capacity: 1GiB\n   bad: [\n")
    with pytest.raises(ConfigError, match=r"broken.yaml:\d+: invalid YAML"):
        KVStrataConfig.from_yaml(f)
    g = tmp_path / "typo.yaml"
    g.write_text("gpu: {num_block: 3}\n")
    with pytest.raises(ConfigError, match=r"typo.yaml: gpu.num_block: unknown key; did you mean 'num_blocks'"):
        KVStrataConfig.from_yaml(g)
    with pytest.raises(ConfigError, match="config file not found"):
        KVStrataConfig.from_yaml(tmp_path / "missing.yaml")
    h = tmp_path / "list.yaml"
    h.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        KVStrataConfig.from_yaml(h)


def test_config_is_frozen():
    cfg = KVStrataConfig.from_dict({})
    with pytest.raises(AttributeError):
        cfg.block_size = 32  # type: ignore[misc]


@pytest.mark.parametrize("host", ["", " ", 7, None, "127.0.0.1 ::1"])
def test_metrics_host_must_be_an_address(host: object) -> None:
    with pytest.raises(ConfigError, match="metrics.host: expected an address to listen on"):
        KVStrataConfig.from_dict({"metrics": {"host": host}})
    assert KVStrataConfig.from_dict({"metrics": {"host": "127.0.0.1"}}).metrics.host == "127.0.0.1"


# ---------------------------------------------------------------- config values through TieredKVCache

def _library_config(tmp_path: Path, *overrides: str) -> KVStrataConfig:
    base = {"block_size": 4, "model": {"block_nbytes": 256}, "cpu": {"capacity": "4KiB"},
            "ssd": {"path": str(tmp_path / "ssd"), "capacity": "2MiB"}}
    return KVStrataConfig.from_dict(base, list(overrides))


@pytest.mark.parametrize("overrides", [
    ("gpu.num_blocks=8",), ("gpu.num_blocks=8", "gpu.device=auto"), ("gpu.device=cpu",),
    ("gpu.num_blocks=null", "gpu.capacity=2KiB"), ("gpu.num_blocks=null", "gpu.capacity=2100"),
])
def test_gpu_values_that_describe_the_kv_pool_are_accepted(tmp_path: Path, overrides: tuple[str, ...]) -> None:
    import torch

    from kvstrata import TieredKVCache

    pool = torch.zeros((8, 256), dtype=torch.uint8)
    with TieredKVCache(_library_config(tmp_path, *overrides), kv_pool=pool) as cache:
        assert cache.kv_pool is pool and cache.manager.num_blocks == 8


@pytest.mark.parametrize("overrides,message", [
    (("gpu.num_blocks=1024",), "gpu.num_blocks: 1024 in the config, but the kv_pool passed to TieredKVCache "
                               "has 8 blocks"),
    (("gpu.num_blocks=null", "gpu.capacity=1MiB"), "gpu.capacity: 1.0 MiB in the config is 4096 blocks of 256 "
                                                   "bytes, but the kv_pool passed to TieredKVCache has 8 blocks"),
    (("gpu.device=cuda:1",), "gpu.device: cuda:1 in the config, but the kv_pool passed to TieredKVCache is on cpu"),
    (("gpu.device=cuda",), "gpu.device: cuda in the config, but the kv_pool passed to TieredKVCache is on cpu"),
])
def test_gpu_values_that_contradict_the_kv_pool_name_the_key_and_both_values(
        tmp_path: Path, overrides: tuple[str, ...], message: str) -> None:
    import torch

    from kvstrata import TieredKVCache

    pool = torch.zeros((8, 256), dtype=torch.uint8)
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        TieredKVCache(_library_config(tmp_path, *overrides), kv_pool=pool)
    assert not (tmp_path / "ssd").exists()  # refused before any tier opened


def test_default_yaml_describes_a_pool_of_its_size(tmp_path: Path) -> None:
    """What the README's library snippet does: default.yaml sets gpu.num_blocks and gpu.device."""
    cfg = KVStrataConfig.from_yaml(ROOT / "configs" / "default.yaml", [f"ssd.path={tmp_path / 'ssd'}"])
    assert {"gpu.num_blocks", "gpu.device"} <= cfg.explicit
    cfg.check_kv_pool(1024, cfg.block_nbytes(), "cpu")
    cfg.check_kv_pool(1024, cfg.block_nbytes(), "cuda:3")
    with pytest.raises(ConfigError, match="^gpu.num_blocks: 1024 in the config, but the kv_pool passed to "
                                          "TieredKVCache has 512 blocks$"):
        cfg.check_kv_pool(512, cfg.block_nbytes(), "cpu")


@pytest.mark.parametrize("override,message", [
    ("ssd.path=/nonexistent-parent/kvstrata", "ssd.path: the parent directory /nonexistent-parent does not exist"),
    ("ssd.path=/etc/hostname", "ssd.path: /etc/hostname exists and is not a directory"),
    ("ssd.capacity=512KiB", "ssd.capacity: 524288 is too small"),
    ("ssd.queue_capacity=0", "ssd.queue_capacity: expected an integer >= 1, got 0"),
    ("model.block_nbytes=0", "model.block_nbytes: expected a positive size, got 0"),
])
def test_errors_from_config_values_name_the_config_key(tmp_path: Path, override: str, message: str) -> None:
    from kvstrata import TieredKVCache

    if override.startswith("ssd.path=/etc/") and not Path(override.split("=", 1)[1]).is_file():
        pytest.skip("no /etc/hostname here")
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        TieredKVCache(_library_config(tmp_path, "gpu.num_blocks=8", override))


def test_a_second_owner_of_ssd_path_is_named_by_its_key(tmp_path: Path) -> None:
    from kvstrata import TieredKVCache

    with TieredKVCache(_library_config(tmp_path, "gpu.num_blocks=8")):
        with pytest.raises(ConfigError, match=r"^ssd.path: .* is in use by this process"):
            TieredKVCache(_library_config(tmp_path, "gpu.num_blocks=8"))


@pytest.mark.parametrize("source", ["default", "configs/vllm-remote.yaml", "configs/chat-8b-48gb.yaml", "on_evict"])
def test_to_dict_reads_back_as_the_same_config(source: str) -> None:
    repo = Path(__file__).resolve().parents[1]
    cfg = (KVStrataConfig.from_dict({}) if source == "default" else
           KVStrataConfig.from_dict({"spill": {"admission": "on_evict", "watermark": 0.1, "promotion": "exclusive",
                                              "write_through": False}}) if source == "on_evict" else
           KVStrataConfig.from_yaml(repo / source))
    assert KVStrataConfig.from_dict(cfg.to_dict()) == cfg
