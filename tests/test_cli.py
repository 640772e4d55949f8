"""`kvstrata bench | plan | inspect` end to end: exit codes, one-line errors, JSON schema, PNG."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvstrata.cli import commands as cli
from kvstrata.cli.commands import Progress, main

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"
SMALL = ["--block-size", "4", "--set", "block_size=4", "--set", "model.block_nbytes=1024",
         "--set", "gpu.num_blocks=8", "--set", "cpu.capacity=4KiB", "--set", "ssd.capacity=0"]


def run_cli(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstrata.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          input=stdin, timeout=timeout, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_bench_json_schema_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["bench", "--trace", str(DATA / "small_mooncake.jsonl"), *SMALL, "--json", str(out),
               "--plot", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Hit rate by tier" in text and "Diagnosis" in text and "Recommendation" in text
    r = json.loads(out.read_text())
    for key in ("requests", "block_accesses", "block_tokens", "ideal_hit_rate", "hit_rate", "reuse_gap_s",
                "idle_before_evict_s", "lifetime_s", "mrc", "recommendation", "diagnosis"):
        assert key in r, key
    assert (r["requests"], r["block_accesses"], r["block_tokens"]) == (4, 10, 4)
    assert set(r["hit_rate"]) == {"gpu", "cpu", "ssd", "total"}
    assert r["ideal_hit_rate"] == 0.5 and r["hit_rate"]["total"] == 0.5    # 8 blocks hold the whole trace
    for what in ("reuse_gap_s", "idle_before_evict_s", "lifetime_s"):
        assert {"p50", "p90", "p99"} <= set(r[what])
    assert r["reuse_gap_s"]["p50"] == 3.0                                   # gaps 1, 1, 3, 3, 4 s
    assert [4 * 4, 0.4] in r["mrc"] and all(len(p) == 2 for p in r["mrc"])   # 4 blocks of 4 tokens
    assert r["recommendation"]["targets"][0]["fraction_of_ideal"] == 0.9
    assert r["diagnosis"]["messages"]
    w, h = png_size(png)
    assert 600 <= w <= 3000 and 300 <= h <= 2000
    import matplotlib.image

    assert matplotlib.image.imread(str(png)).shape[:2] == (h, w)


def test_bench_default_workload_quiet_json_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--workload", "agent", "--seed", "3", "--scale", "0.3", "--json", "-"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["trace"]["format"] == "workload" and r["hit_rate"]["total"] > 0.5


@pytest.mark.parametrize("lines, where", [
    (['{"timestamp": 0, "hash_ids": [1]}', '{"timestamp": 1, "hash_ids": [1,'], ":2: truncated"),
    (['{"timestamp": 0, "hash_ids": [1]}', '{"timestamp": 1}'], ":2: missing 'hash_ids'"),
    (['{"timestamp": 9, "hash_ids": [1]}', '{"timestamp": 1, "hash_ids": [2]}'], ":2: timestamp"),
    ([''], ":1: empty trace"),
    (['{"timestamp": 0, "hash_ids": [1]}', '{"timestamp": 1, "hash_ids": [1%s]}' % ("0" * 5000)],
     ":2: a number has more than 4300 digits"),
    (['{"timestamp": 1%s, "hash_ids": [1]}' % ("0" * 400)], ":1: 'timestamp' must be a finite number"),
    (['{"timestamp": 0, "hash_ids": [1], "x": %s}' % ("[" * 5000 + "]" * 5000)], ":1: JSON nested too deeply"),
    (['{"timestamp": 0, "token_ids": [1, 2, 3], "cache_salt": [1]}'], ":1: 'cache_salt' must be a string"),
    (['{"timestamp": 0, "token_ids": [1, 2, 3, 4, 5]}', '{"timestamp": 1, "block_hashes": [1, 2, 3], '
      '"input_length": 1}'], ":2: 'input_length' 1 is too small"),
    (['{"timestamp": 0, "hash_ids": [1], "output_length": 1%s}' % ("0" * 30)], ":1: 'output_length' must be"),
], ids=["truncated", "missing-ids", "unsorted", "empty", "huge-id", "huge-timestamp", "deep", "list-salt",
        "short-input-length", "huge-output-length"])
def test_bad_trace_is_one_line_error_exit_2(tmp_path: Path, lines: list[str], where: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(lines) + "\n")
    res = run_cli("bench", "--trace", str(p), "--quiet")
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert res.stderr.startswith(f"kvstrata: error: {p}{where}")


def test_missing_file_bad_override_and_skip_bad_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--trace", str(tmp_path / "none.jsonl"), "--quiet"]) == 2
    assert "none.jsonl: trace file not found" in capsys.readouterr().err
    assert main(["bench", "--set", "cpu.capacity=lots", "--quiet"]) == 2
    assert capsys.readouterr().err.startswith("kvstrata: error: cpu.capacity")
    p = tmp_path / "dirty.jsonl"
    p.write_text('{"timestamp": 0, "hash_ids": [1]}\nnot json\n{"timestamp": 1, "hash_ids": [1]}\n')
    assert main(["bench", "--trace", str(p), *SMALL, "--quiet"]) == 2
    assert main(["bench", "--trace", str(p), *SMALL, "--skip-bad-lines", "--json", str(tmp_path / "o.json")]) == 0
    err = capsys.readouterr().err
    assert "skipped 1 bad line (first:" in err and "dirty.jsonl:2" in err
    assert json.loads((tmp_path / "o.json").read_text())["trace"]["skipped_lines"] == 1


def test_skip_bad_lines_skips_and_counts_every_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = [b'{"timestamp": 1, "token_ids": [1%s]}' % (b"0" * 5000),
           b'{"timestamp": 1%s, "token_ids": [1]}' % (b"0" * 400),
           b'{"timestamp": 1, "token_ids": [1], "x": %s}' % (b"[" * 5000 + b"]" * 5000),
           b'{"timestamp": 1, "token_ids": [1, 2, 3, 4, 5], "cache_salt": [1]}',
           b'{"timestamp": 1, "block_hashes": [1, 2, 3], "input_length": 1}',
           b'{"timestamp": 1, "token_ids": [1], "note": "\xff"}',
           b"not json"]
    good = b'{"timestamp": %d, "token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9]}'
    p = tmp_path / "dirty.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + b"\n".join(good % 0 + b"\n" + line for line in bad) + b"\n" + good % 9 + b"\n")
    out = tmp_path / "o.json"
    assert main(["bench", "--trace", str(p), *SMALL, "--skip-bad-lines", "--json", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"skipped {len(bad)} bad lines (first: {p}:2: a number has more than 4300 digits)" in err
    report = json.loads(out.read_text())
    assert report["trace"]["skipped_lines"] == len(bad) and report["requests"] == len(bad) + 1
    assert main(["inspect", "--trace", str(p), "--block-size", "4", "--skip-bad-lines", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["skipped_lines"] == len(bad)


def test_endless_line_is_an_error_not_a_hang() -> None:
    res = run_cli("bench", "--trace", "/dev/zero", "--quiet", timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr == "kvstrata: error: /dev/zero:1: line longer than 16777216 bytes\n"


def test_trace_on_stdin_is_read_once() -> None:
    trace = (DATA / "small_mooncake.jsonl").read_text()
    res = run_cli("bench", "--trace", "/dev/stdin", *SMALL, "--json", "-", "--quiet", stdin=trace)
    assert res.returncode == 0, res.stderr
    assert (json.loads(res.stdout)["requests"], res.stderr) == (4, "")


def test_trace_in_a_fifo_is_read_once(tmp_path: Path) -> None:
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    trace = (DATA / "small_mooncake.jsonl").read_bytes()

    def feed() -> None:
        with open(fifo, "wb") as fh:
            fh.write(trace)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    res = run_cli("bench", "--trace", str(fifo), *SMALL, "--json", "-", "--quiet", timeout=60)
    writer.join(5)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["requests"] == 4


def test_pipe_progress_counts_lines_read(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "Progress", lambda enabled: Progress(enabled, sys.stderr, delay=0.0))
    r, w = os.pipe()
    lines = b"".join(b'{"timestamp": %d, "hash_ids": [%d]}\n' % (i, i % 50) for i in range(5000))

    def feed() -> None:
        with os.fdopen(w, "wb") as fh:
            fh.write(lines)

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        rc = main(["bench", "--trace", f"/dev/fd/{r}", *SMALL, "--progress", "--json", os.devnull])
    finally:
        os.close(r)  # first: a run that stopped early must not leave the writer blocked on a full pipe
        writer.join(10)
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "reading  4,096 lines, 0.1 MiB" in err and "%" not in err.split("replay")[0]


def test_reading_progress_shows_a_fraction_only_of_a_known_size() -> None:
    out = io.StringIO()
    progress = Progress(True, out, delay=0.0)
    progress.reading("reading", None)(12_345, 3 << 20)
    assert out.getvalue().startswith("\rreading  12,345 lines, 3.0 MiB ")
    progress.done()
    out.truncate(0)
    progress.reading("reading", 4 << 20)(12_345, 3 << 20)
    assert "75.0% 12,345 lines, 3.0 MiB" in out.getvalue()


def test_requests_larger_than_the_pool_are_reported_not_fatal(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    rc = main(["bench", "--trace", str(DATA / "small_mooncake.jsonl"), "--set", "gpu.num_blocks=64",
               "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    rejected = report["replay"]["rejected"]
    assert rejected["requests"] > 0 and report["miss_reasons"]["rejected"] > 0
    assert "--set gpu.num_blocks=" in rejected["admit_with"] and rejected["admit_with"] in text
    need = int(rejected["admit_with"].split("=")[1].split()[0])
    assert need * 16 >= rejected["largest_tokens"] > 64 * 16
    rc = main(["bench", "--trace", str(DATA / "small_mooncake.jsonl"), "--set", f"gpu.num_blocks={need}",
               "--json", str(out), "--quiet"])
    assert rc == 0 and json.loads(out.read_text())["replay"]["rejected"]["requests"] == 0


def test_admission_both_compares_modes_in_one_report(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert main(["bench", "--workload", "chat", "--admission", "both", "--set", "gpu.num_blocks=512",
                 "--json", str(out), "--quiet"]) == 0
    cmp = json.loads(out.read_text())["admission_comparison"]
    assert set(cmp) == {"on_compute", "on_evict"}
    for mode in cmp.values():
        assert mode["blocks_written"]["cpu"] > 0 and mode["hit_rate"]["total"] > 0
    # on_compute writes every computed block down, on_evict only what the GPU pool lets go
    assert cmp["on_compute"]["blocks_written"]["cpu"] > cmp["on_evict"]["blocks_written"]["cpu"]
    from kvstrata.bench.report import render_text

    text = render_text(json.loads(out.read_text()))
    assert "SSD writes per hit (any tier)" in text  # the label says what it divides by
    c = cmp["on_compute"]
    assert c["ssd_bytes_written_per_hit"] == round(c["ssd_bytes_written"] / sum(c["hit_blocks"].values()), 1)


def test_admission_flag_decides_before_the_config_is_checked(tmp_path: Path) -> None:
    """Keys only on_evict uses are valid with --admission on_evict on the default deployment
    (whose admission is on_compute), and the report names the mode replayed."""
    out = tmp_path / "r.json"
    assert main(["bench", "--workload", "chat", "--admission", "on_evict", "--set", "spill.watermark=0.05",
                 "--set", "spill.promotion=exclusive", "--json", str(out), "--quiet"]) == 0
    policy = json.loads(out.read_text())["policy"]
    assert (policy["admission"], policy["promotion"]) == ("on_evict", "exclusive")


@pytest.mark.parametrize("flag", [["--block-size", "-1"], ["--scale", "nan"], ["--scale", "-1"], ["--scale", "1e300"],
                                  ["--decode-ms-per-token", "nan"], ["--payload-block-bytes", "0"],
                                  ["--admission", "sometimes"]])
def test_bad_flags_are_usage_errors_without_traceback(flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        rc = main(["bench", "--quiet", *flag])
    except SystemExit as exc:  # argparse's own usage error
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and flag[0] in err


PLAN = ["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128"]


@pytest.mark.parametrize("argv, flag", [
    (["inspect", "--trace", str(DATA / "small_qwen.jsonl"), "--block-size", "-1"], "--block-size"),
    (["inspect", "--trace", str(DATA / "small_qwen.jsonl"), "--block-size", "0"], "--block-size"),
    (["plan", "--layers", "-1", "--kv-heads", "8", "--head-dim", "128", "--kv-pool-gib", "48"], "--layers"),
    ([*PLAN, "--kv-pool-gib", "nan"], "--kv-pool-gib"),
    ([*PLAN, "--kv-pool-gib", "inf"], "--kv-pool-gib"),
    ([*PLAN, "--gpu-mem-gib", "80", "--weights-gib", "16", "--util", "nan"], "--util"),
    ([*PLAN, "--gpu-mem-gib", "nan", "--weights-gib", "16"], "--gpu-mem-gib"),
], ids=["inspect-block-size-negative", "inspect-block-size-zero", "plan-layers", "plan-pool-nan", "plan-pool-inf",
        "plan-util-nan", "plan-gpu-mem-nan"])
def test_bad_inspect_and_plan_flags_are_usage_errors(argv: list[str], flag: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--json", os.devnull])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"error: argument {flag}: expected" in err and "Traceback" not in err


def test_plan_cli_reproduces_the_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    rc = main(["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "fp16",
               "--kv-pool-gib", "48", "--max-model-len", "8192", "--json", str(out)])
    assert rc == 0
    assert "Maximum concurrency for 8,192 tokens per request: 48.00x" in capsys.readouterr().out
    p = json.loads(out.read_text())
    assert (p["bytes_per_token"], p["pool_tokens"], p["max_concurrency"], p["fp8_max_concurrency"]) == \
        (131072, 393216, 48.0, 96.0)
    assert main(["plan", "--kv-pool-gib", "48"]) == 2
    assert "--layers" in capsys.readouterr().err


def test_inspect(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--trace", str(DATA / "small_qwen.jsonl"), "--json", "-"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "qwen" and info["block_accesses"] == 9 and info["ideal_hit_rate"] == pytest.approx(3 / 9)
    assert main(["inspect", "--trace", str(DATA / "small_qwen.jsonl")]) == 0
    text = capsys.readouterr().out
    assert text.startswith("kvstrata inspect: small_qwen.jsonl (qwen)\n")
    assert "  ideal hit rate   33.3% (an unbounded cache" in text and "  block accesses   9 (16-token blocks)" in text
    assert f"  cache for it     {info['saturation_tokens']:,} tokens" in text
    body = text.split("\n", 1)[1]
    assert "{" not in body and "_" not in body  # no raw dict, no field names


def test_max_distinct_blocks_stops_a_trace_too_large_with_one_line(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    trace = str(DATA / "small_mooncake.jsonl")           # 5 distinct blocks, the 5th on line 4
    assert main(["bench", "--trace", trace, *SMALL, "--max-distinct-blocks", "4", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == f"kvstrata: error: {trace}:4: more than 4 distinct blocks (--max-distinct-blocks): stopped before " \
                  "the analysis outgrows the memory it was given\n"
    assert main(["inspect", "--trace", trace, "--max-distinct-blocks", "4"]) == 2
    assert ":4: more than 4 distinct blocks" in capsys.readouterr().err
    for ok in ("5", "0"):                                 # enough, and no limit
        assert main(["bench", "--trace", trace, *SMALL, "--max-distinct-blocks", ok, "--quiet"]) == 0
    with pytest.raises(SystemExit):
        main(["bench", "--trace", trace, "--max-distinct-blocks", "-1", "--quiet"])
    assert "--max-distinct-blocks: expected a non-negative integer" in capsys.readouterr().err


def test_bench_reports_its_peak_memory_and_exact_percentiles(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert main(["bench", "--trace", str(DATA / "small_mooncake.jsonl"), *SMALL, "--json", str(out), "--quiet"]) == 0
    r = json.loads(out.read_text())
    assert r["peak_rss_bytes"]["analysis"] > 1 << 20 and r["peak_rss_bytes"]["curve_process"] is None
    assert r["reuse_gap_s"]["exact"] and all(t["exact"] for t in r["lifetime_s"]["tiers"].values())


def test_version() -> None:
    from kvstrata import __version__

    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"kvstrata {__version__}"


@pytest.mark.parametrize("command", [["bench", "--scale", "0.05"], ["inspect", "--trace", "TRACE"],
                                     ["plan", "--layers", "2", "--kv-heads", "2", "--head-dim", "64",
                                      "--dtype", "fp16", "--kv-pool-gib", "1"]])
def test_an_unwritable_output_is_refused_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         command: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    trace = Path(__file__).parent / "data" / "small_mooncake.jsonl"
    command = [str(trace) if c == "TRACE" else c for c in command]
    ran = []
    monkeypatch.setattr(cli, f"cmd_{command[0]}", lambda args: ran.append(args) or 0)
    for flag, path, why in (("--json", tmp_path / "missing" / "r.json", "does not exist"),
                            ("--json", tmp_path, "is a directory")):
        assert main([*command, flag, str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvstrata: error: {flag}: ") and why in err and "Traceback" not in err
    if command[0] == "bench":
        assert main([*command, "--plot", str(tmp_path / "nowhere" / "p.png")]) == 2
        assert "--plot: " in capsys.readouterr().err
    assert not ran  # refused before the command ran


@pytest.mark.parametrize("trace, forced, detected", [("small_mooncake.jsonl", "qwen", "mooncake"),
                                                      ("small_qwen.jsonl", "mooncake", "qwen"),
                                                      ("small_kvstrata.jsonl", "mooncake", "kvstrata")])
def test_a_format_forced_on_another_formats_trace_is_an_error(capsys: pytest.CaptureFixture[str], trace: str,
                                                             forced: str, detected: str) -> None:
    for command in ("bench", "inspect"):
        assert main([command, "--trace", str(DATA / trace), "--format", forced]) == 2
        err = capsys.readouterr().err
        assert f"--format {forced}, but this is a {detected} trace" in err and f"{trace}:1:" in err
    assert main(["inspect", "--trace", str(DATA / trace), "--format", detected, "--json", "-"]) == 0


def test_report_names_units_and_agrees_with_itself(capsys: pytest.CaptureFixture[str]) -> None:
    """The report says when the trace's blocks are not the config's, writes no lifecycle row
    of dashes, and a tier 'large enough' still names the misses the table counts for it."""
    import re

    trace = str(DATA / "small_mooncake.jsonl")  # 512-token blocks; the default config counts 16
    assert main(["bench", "--trace", trace, "--set", "gpu.num_blocks=64"]) == 0
    text = capsys.readouterr().out
    assert "Blocks of this trace (512 tokens); the config counts blocks of 16 tokens (its GPU pool: 64 of them, " \
           "1,024 tokens)." in text
    assert not re.search(r"^\s+\S*\s+\S+\s+-\s+-\s+-\s+0$", text, re.M)
    assert "No samples (nothing reused or evicted there):" in text


def test_a_tier_large_enough_for_most_reuses_names_what_it_lost() -> None:
    from kvstrata.bench.diagnose import pool_check

    ok = pool_check("ssd", 600.0, 1182.0, 50, missed=2009, accesses=288500)
    assert ok["verdict"] == "ok" and ok["missed"] == 2009
    assert "large enough for most reuses" in ok["message"] and "2,009 accesses (0.7%)" in ok["message"]
    assert pool_check("ssd", 600.0, 1182.0, 50)["message"].startswith("SSD: large enough. ")


def test_plot_draws_no_zero_gap_on_its_log_axis() -> None:
    """Zero gaps (a block reused in the same step) are not drawn at an invented 1 ms: the
    curve starts at the fraction they make up, which the label states."""
    from kvstrata.bench.plot import _ecdf_points
    from kvstrata.bench.stats import Quantiles

    q = Quantiles()
    q.add([0.0] * 30 + [float(i) for i in range(1, 71)])
    x, frac, zeros = _ecdf_points(q)
    assert (x > 0).all() and x.min() >= 1.0 and zeros == pytest.approx(0.3, abs=0.02)
    assert frac[0] == pytest.approx(zeros)


@pytest.mark.parametrize("what", ["config", "recording part"])
def test_a_fifo_is_refused_at_once_naming_it(tmp_path: Path, what: str) -> None:
    """Regression: a FIFO given as a config, or named ``*.jsonl`` in a recording directory,
    hung the command. (A FIFO given as the trace itself is a stream, read once: see
    test_trace_in_a_fifo_is_read_once.)"""
    fifo = tmp_path / "x.jsonl"
    os.mkfifo(fifo)
    if what == "config":
        res = run_cli("bench", "--trace", str(DATA / "small_mooncake.jsonl"), "--config", str(fifo), "--quiet",
                      timeout=30)
    else:
        res = run_cli("bench", "--trace", str(tmp_path), "--quiet", timeout=30)  # the directory holds only the FIFO
    assert res.returncode == 2, res.stderr
    assert str(fifo) in res.stderr and "Traceback" not in res.stderr


def test_a_deployment_too_large_to_replay_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    """Regression: the replay spent ~115 bytes per GPU-pool block of whatever the config (or a
    recording's header) asked for: 5x10^7 blocks were killed at 4 GiB."""
    res = run_cli("bench", "--trace", str(DATA / "small_mooncake.jsonl"), *SMALL, "--set", "gpu.num_blocks=1000000000",
                  "--quiet", timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "gpu.num_blocks" in res.stderr and "--max-memory" in res.stderr
    payload = run_cli("bench", "--trace", str(DATA / "small_mooncake.jsonl"), *SMALL, "--max-memory", "16MiB",
                      "--payload", "--payload-block-bytes", "1KiB", "--set", "cpu.capacity=64MiB", "--quiet", timeout=60)
    assert payload.returncode == 2 and "cpu.capacity" in payload.stderr, payload.stderr  # the slab's bytes
    ok = run_cli("bench", "--trace", str(DATA / "small_mooncake.jsonl"), *SMALL, "--max-memory", "1GiB", "--quiet",
                 timeout=60)
    assert ok.returncode == 0, ok.stderr


def test_a_recording_header_whose_section_is_not_a_mapping_is_one_line(tmp_path: Path) -> None:
    header = {"kvstrata_trace": 3, "block_size": 16, "recording": {"id": "x", "part": 0, "started": 0,
                                                                   "sample": 1.0, "keyed": False},
              "deployment": {"config": {"gpu": 5}}}
    line = {"timestamp": 0, "input_length": 32, "output_length": 1, "block_hashes": ["00" * 16, "01" * 16],
            "output_block_hashes": [], "duration": 1}
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(header) + "\n" + json.dumps(line) + "\n")
    res = run_cli("bench", "--trace", str(path), "--set", "gpu.capacity=1GiB", "--quiet", timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "gpu: expected a mapping" in res.stderr
