"""Every input to ``kvstrata bench``, ``plan`` and the config is bounded and read as a user
expects: the KV-cache group count, a recording's measured figures and recorded deployment,
numbers in e-notation, and each ``plan`` argument and model config field.

Runs the real CLI in a subprocess (a refusal is exit 2, one line, no traceback) on the
recording in ``tests/data/recording``, copied and edited where a test forges it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstrata.config.schema import KVStrataConfig
from kvstrata.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"
RECORDING = DATA / "recording"
SMALL = ["--block-size", "4", "--set", "block_size=4", "--set", "model.block_nbytes=1024",
         "--set", "gpu.num_blocks=8", "--set", "cpu.capacity=4KiB", "--set", "ssd.capacity=0"]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstrata.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def refused(p: subprocess.CompletedProcess[str], *words: str) -> str:
    """The one-line error of a run refused as a user mistake, holding every one of ``words``."""
    assert p.returncode == 2, (p.returncode, p.stdout[-500:], p.stderr[-2000:])
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr[-2000:]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def forged_recording(tmp: Path, header: Any = None, load: dict[str, Any] | None = None) -> Path:
    """A copy of the test recording; ``header(h)`` edits its header, ``load`` becomes what the
    plugin measured of load costs."""
    d = tmp / "rec"
    shutil.copytree(RECORDING, d)
    if header is not None:
        part = next(d.glob("*.jsonl"))
        first, rest = part.read_text().split("\n", 1)
        h = json.loads(first)
        header(h)
        part.write_text(json.dumps(h) + "\n" + rest)
    if load is not None:
        m = next(d.glob("*.measured.json"))
        body = json.loads(m.read_text())
        body["measured"]["load"] = load
        m.write_text(json.dumps(body))
    return d


# ------------------------------------------------------------------ KV-cache groups

def test_more_groups_than_the_cap_are_refused_naming_the_key_and_the_cap(tmp_path: Path) -> None:
    from kvstrata.identity.groups import MAX_GROUPS

    many = ",".join(["full"] * (MAX_GROUPS + 1))
    p = run_cli("bench", "--trace", str(DATA / "small_mooncake.jsonl"), *SMALL, "--set", f"model.groups={many}",
                "--quiet")
    refused(p, "model.groups", f"{MAX_GROUPS + 1:,} KV-cache groups", f"more than {MAX_GROUPS}")

    def groups(h: dict[str, Any]) -> None:
        h["deployment"]["engine"]["groups"] = ",".join(["full"] * 10_000)

    p = run_cli("bench", "--trace", str(forged_recording(tmp_path, groups)), "--quiet", "--max-memory", "256MiB")
    refused(p, "trace: the recorded deployment: model.groups", "10,000 KV-cache groups", f"more than {MAX_GROUPS}")
    with pytest.raises(ConfigError, match=rf"^model\.groups: 200 KV-cache groups, more than {MAX_GROUPS}"):
        KVStrataConfig.from_dict({"model": {"groups": ["full"] * 200}})
    assert KVStrataConfig.from_dict({"model": {"groups": ",".join(["full"] * MAX_GROUPS)}}).model.num_groups \
        == MAX_GROUPS


def test_the_memory_estimate_counts_every_group() -> None:
    """A deployment under the group cap whose groups take it over --max-memory is refused
    before anything is built; the same pool with one group replays."""
    pool = ["--block-size", "16", "--set", "gpu.num_blocks=200000", "--max-memory", "64MiB", "--quiet"]
    trace = ["bench", "--trace", str(DATA / "small_mooncake.jsonl")]
    assert run_cli(*trace, *pool).returncode == 0
    p = run_cli(*trace, *pool, "--set", "model.groups=full,sliding:1024")
    refused(p, "gpu.num_blocks", "2 KV-cache groups (model.groups)", "--max-memory 64.0 MiB")

    from kvstrata.bench.budget import default_max_distinct_blocks, deployment_bytes

    assert deployment_bytes({"gpu": 1000}, groups=8)["gpu"] > deployment_bytes({"gpu": 1000})["gpu"]
    plain, hybrid = default_max_distinct_blocks("mooncake", 0), default_max_distinct_blocks("mooncake", 0, 32)
    if plain is not None:  # the analysis holds fewer distinct blocks of a model with more groups
        assert hybrid is not None and hybrid < plain


def test_compare_counts_every_group() -> None:
    from kvstrata.bench.compare import _check_memory

    one = KVStrataConfig.from_dict({"gpu": {"num_blocks": 100}, "ssd": {"capacity": "1MiB"}})
    many = KVStrataConfig.from_dict({"gpu": {"num_blocks": 100}, "ssd": {"capacity": "1MiB"},
                                     "model": {"groups": ",".join(["full"] * 100)}})
    limit = 64 << 20
    _check_memory(one, 16, 16, 10_000, limit)  # 16 rows of 10,000 distinct blocks: ~40 MB
    with pytest.raises(ConfigError, match=r"^--compare: .*10,000 distinct blocks, 100 KV-cache groups"):
        _check_memory(many, 16, 16, 10_000, limit)


# ------------------------------------------------------------------ recordings

def test_a_slow_measured_figure_replays(tmp_path: Path) -> None:
    """1 byte in 10^6 s: a bandwidth under 1 byte/s is left out, not truncated to 0 and refused."""
    rec = forged_recording(tmp_path, load={"block_seconds": {"cpu": 1e-5, "ssd": 1e6}, "latency_seconds": {},
                                           "token_seconds": 1e-4})
    p = run_cli("bench", "--trace", str(rec), "--quiet", "--json", str(tmp_path / "r.json"))
    assert p.returncode == 0, p.stderr[-2000:]

    from kvstrata.bench.deployment import recorded_load

    figures = recorded_load({"block_nbytes": 32768, "load": {"block_seconds": {"cpu": 32768 / 1.5, "ssd": 1e6}}})
    assert figures == {"cpu_bandwidth": 2}  # 1.5 bytes/s rounds to 2; 0.03 bytes/s is left out


def test_set_fixes_a_bad_recorded_value(tmp_path: Path) -> None:
    def bad_margin(h: dict[str, Any]) -> None:
        h["deployment"]["config"]["load"] = {"margin": -5}

    rec = str(forged_recording(tmp_path, bad_margin))
    refused(run_cli("bench", "--trace", rec, "--quiet"), "trace: the recorded deployment: load.margin")
    assert run_cli("bench", "--trace", rec, "--quiet", "--set", "load.margin=0.2").returncode == 0
    line = refused(run_cli("bench", "--trace", rec, "--quiet", "--set", "load.margin=-1"), "load.margin")
    assert "recorded deployment" not in line  # the bad value is the --set one


def test_a_huge_measured_figure_prints_bounded_lines(tmp_path: Path) -> None:
    rec = forged_recording(tmp_path, load={"block_seconds": {"cpu": 1e-5, "ssd": 1e-5}, "latency_seconds": {},
                                           "token_seconds": 1e300, "attended_seconds": 1e300})
    p = run_cli("bench", "--trace", str(rec))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "e+304 ms" in p.stdout  # the estimated TTFT, in scientific notation
    assert max(len(line) for line in p.stdout.splitlines()) <= 300


def test_numbers_are_shown_in_bounded_width() -> None:
    from kvstrata.system.values import format_number, format_size

    for x in (1e300, -1e300, float("inf"), float("nan"), 5e-320, 2.0**1000):
        assert len(format_number(x)) <= 21 and len(format_number(x, ",.1f")) <= 21
        assert len(format_size(x)) <= 25
    assert format_number(3540.25) == "3,540" and format_size(1.5 * 2**30) == "1.5 GiB"


# ------------------------------------------------------------------ e-notation

E_NOTATION = ["1e5", "1.0e5", "2e12", "1e-4"]


@pytest.mark.parametrize("text", E_NOTATION)
def test_load_values_in_e_notation_from_set_and_yaml(text: str, tmp_path: Path) -> None:
    value = float(text)
    sets = [f"load.prefill_rate={text}", f"load.attention_rate={text}"]
    sets += [f"load.ssd_bandwidth={text}"] if value >= 1 else ["load.ssd_bandwidth=1GiB", f"load.ssd_latency={text}"]
    from_set = KVStrataConfig.from_dict({}, sets).load
    yaml = tmp_path / "c.yaml"
    yaml.write_text("load:\n" + "".join(f"  {s.split('=')[0].split('.')[1]}: {s.split('=')[1]}\n" for s in sets))
    from_yaml = KVStrataConfig.from_yaml(yaml).load
    for load in (from_set, from_yaml):
        assert load.prefill_rate == value and load.attention_rate == value
        if value >= 1:
            assert load.ssd_bandwidth == int(value)
        else:
            assert load.ssd_latency == value and load.ssd_bandwidth == 1 << 30


def test_e_notation_reaches_every_numeric_key() -> None:
    cfg = KVStrataConfig.from_dict({}, ["load.warmup=1e3", "load.margin=5e-2", "gpu.num_blocks=1e4",
                                        "cpu.capacity=2e9"])
    assert (cfg.load.warmup, cfg.load.margin, cfg.gpu.num_blocks, cfg.cpu.capacity) == (1000, 0.05, 10_000, 2 * 10**9)
    with pytest.raises(ConfigError, match=r"^load\.warmup: must be <= 1048576, got 2000000000000"):
        KVStrataConfig.from_dict({}, ["load.warmup=2e12"])
    with pytest.raises(ConfigError, match=r"^gpu\.num_blocks: expected an integer, got 1.5"):
        KVStrataConfig.from_dict({}, ["gpu.num_blocks=1.5e0"])
    assert KVStrataConfig.from_dict({}, ["model.name=1e5x"]).model.name == "1e5x"  # not a number: a string


def test_e_notation_through_the_cli(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    p = run_cli("bench", "--trace", str(DATA / "small_mooncake.jsonl"), *SMALL, "--set", "load.prefill_rate=1e5",
                "--set", "load.cpu_bandwidth=2e12", "--quiet", "--json", str(out))
    assert p.returncode == 0, p.stderr[-2000:]


# ------------------------------------------------------------------ plan

PLAN = ["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128"]
QWEN3_NEXT = {"num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
              "hidden_size": 2048, "torch_dtype": "bfloat16", "full_attention_interval": 4,
              "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
              "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}


def _config(tmp: Path, name: str, body: Any) -> str:
    p = tmp / name
    p.write_text(body if isinstance(body, str) else json.dumps(body))
    return str(p)


def test_plan_bad_inputs_are_one_line_errors(tmp_path: Path) -> None:
    deep = _config(tmp_path, "deep.json", "[" * 100_000 + "]" * 100_000)
    heads = _config(tmp_path, "heads.json", {**QWEN3_NEXT, "linear_num_value_heads": 10**9})
    state = _config(tmp_path, "state.json", {**QWEN3_NEXT, "linear_key_head_dim": 10**6,
                                              "linear_value_head_dim": 10**6})
    layers = _config(tmp_path, "layers.json", {**QWEN3_NEXT, "num_hidden_layers": 10**9})
    cases = [
        ([*PLAN, "--kv-pool-gib", "1e300"], ["--kv-pool-gib", "at most 1,048,576"]),
        ([*PLAN, "--gpu-mem-gib", "1e300", "--weights-gib", "1"], ["--gpu-mem-gib", "at most 1,048,576"]),
        ([*PLAN, "--gpu-mem-gib", "80", "--weights-gib", "1e300"], ["--weights-gib", "at most 1,048,576"]),
        (["plan", "--layers", "1000000000", "--kv-heads", "8", "--head-dim", "128", "--kv-pool-gib", "8"],
         ["--layers", "at most 10,000"]),
        ([*PLAN, "--kv-pool-gib", "8", "--max-model-len", "100000000000"], ["--max-model-len", "at most"]),
        ([*PLAN, "--kv-pool-gib", "8", "--block-size", "100000000"], ["--block-size", "at most 65,536"]),
        (["plan", "--model-config", deep, "--kv-pool-gib", "8"], [deep, "nested too deeply"]),
        (["plan", "--model-config", heads, "--kv-pool-gib", "8"], [heads, "linear_num_value_heads", "at most 10,000"]),
        (["plan", "--model-config", state, "--kv-pool-gib", "8"], [state, "linear_value_head_dim", "at most"]),
        (["plan", "--model-config", layers, "--kv-pool-gib", "8"], [layers, "num_hidden_layers", "at most 10,000"]),
    ]
    for argv, words in cases:
        refused(run_cli(*argv), *words)
    ok = run_cli("plan", "--model-config", _config(tmp_path, "ok.json", QWEN3_NEXT), "--kv-pool-gib", "8")
    assert ok.returncode == 0 and "state (linear_attention) x3" in ok.stdout
