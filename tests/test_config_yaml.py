"""Reading config YAML that is hostile or broken: alias bombs, deep nesting, huge files,
bytes that are not UTF-8, huge numbers. Each is a one-line ``ConfigError`` naming the
file (and line), found before any value is used; the CLI prints it without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata import ConfigError
from kvstrata.cli.commands import main
from kvstrata.config.schema import KVStrataConfig, key_paths, read_yaml

ROOT = Path(__file__).resolve().parents[1]


def alias_bomb(levels: int, width: int = 9) -> str:
    """``cpu.capacity`` as a "billion laughs": ``width ** levels`` strings through aliases."""
    value = "&a0 [" + ", ".join(["lol"] * width) + "]"
    for i in range(1, levels):
        value = f"&a{i} [{value}, " + ", ".join([f"*a{i - 1}"] * (width - 1)) + "]"
    return f"cpu:\n  capacity: {value}\n"


def write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    f = tmp_path / name
    if isinstance(text, bytes):
        f.write_bytes(text)
    else:
        f.write_text(text, encoding="utf-8")
    return f


def run_cli_bounded(config: Path) -> subprocess.CompletedProcess[str]:
    """``kvstrata bench --config FILE --quiet`` in a child process held to 1 GiB of address
    space and 60 s, so a regression fails the test instead of exhausting the machine."""
    def limit() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))

    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "kvstrata.cli", "bench", "--config", str(config), "--quiet"],
                          capture_output=True, text=True, timeout=60, preexec_fn=limit, cwd=ROOT, env=env)


# --------------------------------------------------------------------------- aliases

def test_alias_bomb_is_refused_while_reading(tmp_path):
    f = write(tmp_path, "bomb.yaml", alias_bomb(10))
    with pytest.raises(ConfigError, match=r"bomb\.yaml:2: YAML holds more than 10,000 values with aliases expanded"):
        read_yaml(f)


@pytest.mark.skipif(sys.platform != "linux", reason="address-space limit of the child process")
def test_alias_bomb_through_the_cli_is_one_line(tmp_path):
    f = write(tmp_path, "bomb.yaml", alias_bomb(10))
    proc = run_cli_bounded(f)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == f"kvstrata: error: {f}:2: YAML holds more than 10,000 values with aliases expanded\n"


def test_alias_bomb_in_an_override_is_refused():
    bomb = alias_bomb(5, width=10).split("capacity: ", 1)[1].strip()   # 100,000 values
    with pytest.raises(ConfigError, match=r"^cpu\.capacity: YAML holds more than 10,000 values") as e:
        KVStrataConfig.from_dict({}, [f"cpu.capacity={bomb}"])
    assert len(str(e.value)) < 100


def test_alias_inside_its_own_anchor_is_refused(tmp_path):
    f = write(tmp_path, "loop.yaml", "cpu: &c {capacity: *c}\n")
    with pytest.raises(ConfigError, match=r"loop\.yaml:1: YAML alias \*c inside its own anchor"):
        key_paths(read_yaml(f))


def test_plain_aliases_and_merge_keys_still_load(tmp_path):
    f = write(tmp_path, "ok.yaml", "cpu: {capacity: &cap 2GiB}\ngpu: {capacity: *cap}\n"
                                   "ssd: {<<: {path: /tmp/x, level: 3}, capacity: *cap}\n")
    cfg = KVStrataConfig.from_yaml(f)
    assert cfg.cpu.capacity == cfg.gpu.capacity == cfg.ssd.capacity == 2 * 2**30
    assert cfg.ssd.path == "/tmp/x" and cfg.ssd.level == 3


# --------------------------------------------------------------------------- nesting

@pytest.mark.parametrize("opened,closed", [("[", "]"), ("{a: ", "}")])
def test_deep_nesting_is_refused(tmp_path, opened, closed):
    f = write(tmp_path, "deep.yaml", "cpu:\n  capacity: " + opened * 10_000 + "1" * (opened == "{a: ")
              + closed * 10_000 + "\n")
    with pytest.raises(ConfigError, match=r"deep\.yaml:2: YAML nested more than 32 levels deep"):
        read_yaml(f)


def test_deep_nesting_in_an_override_is_refused():
    with pytest.raises(ConfigError, match=r"^cpu\.capacity: YAML nested more than 32 levels deep"):
        KVStrataConfig.from_dict({}, ["cpu.capacity=" + "[" * 10_000 + "]" * 10_000])


def test_nesting_up_to_the_limit_loads(tmp_path):
    f = write(tmp_path, "nested.yaml", "cpu:\n  capacity: " + "[" * 30 + "]" * 30 + "\n")   # 32 levels
    value = read_yaml(f)["cpu"]["capacity"]
    for _ in range(29):
        (value,) = value
    assert value == []
    with pytest.raises(ConfigError, match=r"nested\.yaml: cpu\.capacity: expected a size like '8GiB', got \[\[\["):
        KVStrataConfig.from_yaml(f)


# --------------------------------------------------------------------------- the file itself

def test_bytes_that_are_not_utf8_name_the_file_and_line(tmp_path):
    f = write(tmp_path, "latin1.yaml", b"cpu:\n  capacity: 1GiB\nmodel:\n  name: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"latin1\.yaml:4: not UTF-8 text \(byte 0xe9 at offset 40\)"):
        read_yaml(f)


def test_utf8_text_and_a_byte_order_mark_still_load(tmp_path):
    f = write(tmp_path, "bom.yaml", "\ufeffmodel:\n  name: café\ncpu:\n  capacity: 1GiB\n".encode())
    cfg = KVStrataConfig.from_yaml(f)
    assert cfg.model.name == "café" and cfg.cpu.capacity == 2**30


def test_a_file_over_one_mib_is_refused(tmp_path):
    f = write(tmp_path, "huge.yaml", "# " + "x" * 2**20 + "\ncpu: {capacity: 1GiB}\n")
    with pytest.raises(ConfigError, match=r"huge\.yaml: larger than 1\.0 MiB; not a config file"):
        read_yaml(f)


def test_an_integer_too_long_to_convert_is_refused(tmp_path):
    f = write(tmp_path, "digits.yaml", "cpu:\n  capacity: 1" + "0" * 5000 + "\n")
    with pytest.raises(ConfigError, match=r"digits\.yaml:2: integer out of range \(5,001 characters\)"):
        read_yaml(f)


def test_yaml_syntax_errors_do_not_print_whole_values(tmp_path):
    f = write(tmp_path, "alias.yaml", "cpu:\n  capacity: *" + "x" * 5000 + "\n")
    with pytest.raises(ConfigError, match=r"alias\.yaml:2: invalid YAML: found undefined alias 'xxx") as e:
        read_yaml(f)
    assert len(str(e.value)) < len(str(f)) + 120


# --------------------------------------------------------------------------- the CLI

CLI_CASES = {
    "deep": ("cpu:\n  capacity: " + "[" * 10_000 + "]" * 10_000 + "\n", ":2: YAML nested more than 32 levels deep"),
    "latin1": (b"cpu:\n  capacity: 1GiB\nmodel:\n  name: caf\xe9\n", ":4: not UTF-8 text"),
    "float": ("cpu:\n  capacity: 1.0e+300\n",
              ": cpu.capacity: expected a finite size between 0 and 1 EiB, got 1e+300"),
    "inf": ("ssd:\n  capacity: .inf\n", ": ssd.capacity: expected a finite size between 0 and 1 EiB, got inf"),
    "nan": ("gpu:\n  capacity: .nan\n", ": gpu.capacity: expected a finite size between 0 and 1 EiB, got nan"),
    "digits": ("cpu:\n  capacity: " + "9" * 400 + "GiB\n",
               ": cpu.capacity: expected a finite size between 0 and 1 EiB"),
    "long": ("cpu:\n  capacity: " + "x" * 100_000 + "\n", ": cpu.capacity: expected a size like '8GiB', got 'xxx"),
    "watermark": ("spill: {admission: on_evict, watermark: .nan}\n", ": spill.watermark: expected a fraction between 0"),
}


@pytest.mark.parametrize("name", sorted(CLI_CASES))
def test_cli_prints_one_line_and_no_traceback(tmp_path, capsys, name):
    text, expected = CLI_CASES[name]
    f = write(tmp_path, f"{name}.yaml", text)
    assert main(["bench", "--config", str(f), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvstrata: error: {f}{expected}")
    assert err.count("\n") == 1 and len(err) < len(str(f)) + 200 and "Traceback" not in err
