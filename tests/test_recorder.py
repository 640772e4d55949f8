"""The request recorder (kvstrata.trace.recorder) and reading what it wrote (kvstrata.trace.parts):
real files in temp directories, a real child process whose file size limit makes the
disk "full" (the kernel refuses the write with EFBIG: no mock)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from kvstrata.bench.deployment import recorded_config, recorded_deployment
from kvstrata.errors import ConfigError
from kvstrata.trace.reader import TRACE_VERSION, TraceError, TraceReader, load_trace
from kvstrata.config.schema import KVStrataConfig, TraceConfig
from kvstrata.trace.recorder import RecordedRequest, TraceRecorder, rekey

BS = 16
ROOT = Path(__file__).resolve().parents[1]


def _deployment() -> dict[str, Any]:
    cfg = KVStrataConfig.from_dict({"cpu": {"capacity": "1MiB"}, "ssd": {"path": "/secret/where", "capacity": "8MiB"},
                                  "remote": {"url": "redis://user:password@host:6379/0", "capacity": "1GiB"},
                                  "trace": {"path": "/x"}})
    return recorded_deployment(cfg, block_size=BS, block_nbytes=4096, gpu_blocks=40,
                               capacity_blocks={"gpu": 40, "cpu": 256, "ssd": 1900},
                               engine={"name": "test", "version": "0"})


def _key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8  # 32 bytes, like a sha256 block hash


def _recorder(tmp: Path, clock: Any = time.time, **trace: Any) -> TraceRecorder:
    cfg = TraceConfig.from_dict({"path": str(tmp / "rec"), "insecure_hashes": "secret" not in trace, **trace})
    return TraceRecorder(cfg, block_size=BS, deployment=_deployment(), clock=clock)


def _req(arrival: float, keys: list[int], out: list[int] = (), finish: float | None = None) -> RecordedRequest:
    return RecordedRequest(arrival=arrival, finish=arrival + 1 if finish is None else finish,
                           input_length=len(keys) * BS + 3, output_length=len(out) * BS + 1,
                           keys=[_key(k) for k in keys], output_keys=[_key(k) for k in out])


def _lines(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for f in sorted(directory.glob("*.jsonl")) for line in f.read_text().splitlines()]


def test_records_leave_in_admission_order_and_hold_no_tokens(tmp_path: Path) -> None:
    rec = _recorder(tmp_path)
    t0 = rec.started
    for rid in ("a", "b", "c"):
        rec.admitted(rid)
    rec.finished("b", _req(t0 + 2, [2, 3], [4]))      # finishes first, arrived second: waits for a
    rec.finished("c", _req(t0 + 3, [5]))
    rec.finished("a", _req(t0 + 1, [1, 2]))
    rec.measured({"hits": {"gpu": {"tokens": 16, "blocks": 1}}})
    rec.close()
    header, *reqs = _lines(tmp_path / "rec")
    assert header["kvstrata_trace"] == TRACE_VERSION and header["block_size"] == BS
    assert header["recording"]["part"] == 0 and header["recording"]["id"] == rec.id
    assert header["deployment"]["capacity_blocks"] == {"gpu": 40, "cpu": 256, "ssd": 1900}
    config = header["deployment"]["config"]
    assert "path" not in config["ssd"] and "url" not in config["remote"] and "trace" not in config
    assert "password" not in json.dumps(header) and "/secret" not in json.dumps(header)
    assert [r["timestamp"] for r in reqs] == [pytest.approx(1), pytest.approx(2), pytest.approx(3)]
    assert reqs[1]["block_hashes"] == [_key(2)[:16].hex(), _key(3)[:16].hex()]
    assert reqs[1]["output_block_hashes"] == [_key(4)[:16].hex()]
    assert {k for r in reqs for k in r} == {"timestamp", "duration", "input_length", "output_length",
                                            "block_hashes", "output_block_hashes"}
    measured = json.loads((tmp_path / "rec" / f"{rec.id}.measured.json").read_text())
    assert measured["measured"]["hits"]["gpu"]["tokens"] == 16 and measured["recorder"]["recorded"] == 3


def test_a_secret_rekeys_every_hash(tmp_path: Path) -> None:
    rec = _recorder(tmp_path, secret="s" * 32)
    rec.admitted("a")
    rec.finished("a", _req(rec.started, [1, 2], [3]))
    rec.close()
    header, line = _lines(tmp_path / "rec")
    assert header["recording"]["keyed"] is True
    plain = rekey([_key(1), _key(2)], None)
    assert line["block_hashes"] == rekey([_key(1), _key(2)], b"s" * 32)
    assert not set(line["block_hashes"]) & set(plain) and len(line["block_hashes"][0]) == 32
    assert rekey([_key(1)], b"t" * 32) != rekey([_key(1)], b"s" * 32)  # a deployment's own secret


def test_rotation_and_a_directory_read_in_part_order(tmp_path: Path) -> None:
    rec = _recorder(tmp_path, rotate_bytes="4KiB")
    for i in range(60):
        rec.admitted(str(i))
        rec.finished(str(i), _req(rec.started + i, [i % 7, 100 + i], [200 + i]))
    rec.close()
    files = sorted((tmp_path / "rec").glob("*.jsonl"))
    assert len(files) >= 3
    for i, f in enumerate(reversed(files)):  # names that sort against the part order
        f.rename(f.with_name(f"{i:02d}-renamed.jsonl"))
    trace = load_trace(tmp_path / "rec")
    assert trace.num_requests == 60 and [r.timestamp for r in trace.requests] == sorted(r.timestamp for r in trace.requests)
    assert trace.requests[0].output_blocks and trace.requests[0].duration == pytest.approx(1)
    assert trace.header["recording"]["id"] == rec.id and trace.notes == []


def test_sampling_keeps_a_stable_share_of_the_requests(tmp_path: Path) -> None:
    rec = _recorder(tmp_path, sample=0.25)
    for i in range(400):
        rec.admitted(f"req-{i}")
        rec.finished(f"req-{i}", _req(rec.started + i, [i]))
    rec.close()
    kept = len(_lines(tmp_path / "rec")) - 1
    assert 60 < kept < 140 and rec.counts["sampled_out"] == 400 - kept


def test_an_unwritable_directory_disables_recording_with_one_log_line(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_text("not a directory")
    cfg = TraceConfig.from_dict({"path": str(tmp_path / "file" / "rec"), "insecure_hashes": True})
    with caplog.at_level(logging.WARNING, logger="kvstrata.trace.recorder"):
        rec = TraceRecorder(cfg, block_size=BS, deployment=_deployment())
        for i in range(50):
            rec.admitted(str(i))
            rec.finished(str(i), _req(rec.started + i, [i]))
        rec.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "request recording stopped" in warnings[0].getMessage()
    assert rec.disabled is not None


def test_a_full_disk_stops_recording_and_nothing_else(tmp_path: Path) -> None:
    """A child process whose file size limit (RLIMIT_FSIZE, SIGXFSZ ignored) is 64 KiB: the
    kernel refuses the write that would pass it, as a full disk would."""
    script = textwrap.dedent(f"""
        import logging, resource, signal, sys, time
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from test_recorder import _recorder, _req
        from pathlib import Path
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        rec = _recorder(Path({str(tmp_path)!r}))
        t0 = time.perf_counter()
        for i in range(5000):
            rec.admitted(str(i))
            rec.finished(str(i), _req(rec.started + i, list(range(i, i + 20))))
        took = time.perf_counter() - t0
        rec.close()
        print("disabled:", rec.disabled)
        print("recorded:", rec.counts["recorded"], "took", took)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("request recording stopped") == 1, proc.stdout
    assert "File too large" in proc.stdout
    recorded = int(proc.stdout.split("recorded:")[1].split()[0])
    assert 0 < recorded < 5000
    trace = load_trace(tmp_path / "rec")  # what was written before the limit reads back
    assert 0 < trace.num_requests <= recorded


def test_recorded_config_replays_the_deployment_and_set_changes_one_thing() -> None:
    dep = _deployment()
    cfg = recorded_config(dep)
    assert cfg.gpu.num_blocks == 40 and cfg.cpu.capacity == 1024**2 and cfg.model.block_nbytes == 4096
    assert not cfg.trace.enabled and cfg.remote.url is None
    bigger = recorded_config(dep, ["cpu.capacity=4MiB"])
    assert bigger.cpu.capacity == 4 * 1024**2 and bigger.ssd.capacity == cfg.ssd.capacity
    assert recorded_config(dep, ["gpu.capacity=1MiB"]).gpu.num_blocks is None
    assert cfg.gpu.max_num_batched_tokens is None  # a recording without the engine's tokens per step
    stepped = recorded_deployment(KVStrataConfig(), block_size=BS, block_nbytes=4096, gpu_blocks=40,
                                  capacity_blocks={"gpu": 40}, engine={"name": "test"}, max_num_batched_tokens=2048)
    assert recorded_config(stepped).gpu.max_num_batched_tokens == 2048
    assert recorded_config(stepped, ["gpu.max_num_batched_tokens=512"]).gpu.max_num_batched_tokens == 512


def test_a_recording_of_a_hybrid_model_replays_as_its_groups() -> None:
    """The header's KV-cache groups become ``model.groups``; a forged value is a config
    error naming the key; a state hybrid is replayed as one."""
    from kvstrata.bench.replay import replaying
    from kvstrata.identity.groups import STATE

    dep = _deployment()
    dep["engine"]["groups"] = "sliding:64,full"
    assert recorded_config(dep).model.groups == "sliding:64,full"
    dep["engine"]["groups"] = "window:3"
    with pytest.raises(ConfigError, match=r"^trace: the recorded deployment: model\.groups\[0\]: 'window:3'"):
        recorded_config(dep)
    dep["engine"]["groups"] = "state,full"
    with replaying(recorded_config(dep), 16) as rp:
        assert [g.kind for g in rp.manager.groups.groups] == [STATE, "full"]


# ------------------------------------------------------------------ reading damaged recordings


def _recording(tmp: Path, n: int = 30, **trace: Any) -> Path:
    rec = _recorder(tmp, rotate_bytes="4KiB", **trace)
    for i in range(n):
        rec.admitted(str(i))
        rec.finished(str(i), _req(rec.started + i, [i % 5, 50 + i], [90 + i]))
    rec.measured({"queries": {"tokens": 1}})
    rec.close()
    return tmp / "rec"


def test_a_cut_off_last_line_is_skipped_and_named(tmp_path: Path) -> None:
    d = _recording(tmp_path)
    last = sorted(d.glob("*.jsonl"))[-1]
    with open(last, "ab") as fh:
        fh.write(b'{"timestamp": 99, "block_has')
    trace = load_trace(d)
    assert trace.num_requests == 30
    assert len(trace.notes) == 1 and "the last line is cut off" in trace.notes[0] and last.name in trace.notes[0]


def test_missing_parts_foreign_files_and_newer_versions_are_skipped_and_named(tmp_path: Path) -> None:
    d = _recording(tmp_path)
    parts = sorted(d.glob("*.jsonl"))
    assert len(parts) >= 2
    parts[-1].unlink()  # the last part: only the recorder's count of parts shows it is missing
    (d / "notes.jsonl").write_text('{"hello": 1}\n')
    newer = json.loads(parts[0].read_text().splitlines()[0])
    newer["kvstrata_trace"] = 99
    (d / "future.jsonl").write_text(json.dumps(newer) + "\n")
    reader = TraceReader(d)
    got = list(reader)
    info = reader.info
    text = "\n".join(info.notes)
    assert f"part {len(parts) - 1} missing" in text and "notes.jsonl: does not start with a kvstrata header" in text
    assert "future.jsonl: is written in kvstrata trace format 99" in text
    assert 0 < len(got) < 30 and info.measured is None  # a part is missing: no whole-recording figures


def test_a_directory_with_nothing_usable_is_an_error_naming_why(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"kvstrata_trace": 7, "recording": {"id": "x", "part": 0}}\n')
    with pytest.raises(TraceError, match="no recording to read.*format 7"):
        list(TraceReader(tmp_path))
    from kvstrata.cli.commands import main

    assert main(["bench", "--trace", str(tmp_path), "--quiet"]) == 2


def test_of_two_recordings_the_latest_is_read(tmp_path: Path) -> None:
    clock = iter(range(1000, 2000))
    old = _recorder(tmp_path, clock=lambda: float(next(clock)))
    old.admitted("a")
    old.finished("a", _req(old.started, [1]))
    old.close()
    time.sleep(1.1)  # a later start: another recording id
    d = _recording(tmp_path, n=5)
    trace = load_trace(d)
    assert trace.num_requests == 5
    assert any(f"recording {old.id} (1 part) skipped" in n for n in trace.notes)
    assert trace.measured is not None


# ---------------------------------------------------------------------------- planted links

FIXED = 1_800_000_000.0  # a fixed clock: the recording's id, and so its file names, are known in advance


def _fixed_id() -> str:
    import os

    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(FIXED)) + f"-{os.getpid()}"


def test_a_link_planted_where_the_measurements_go_redirects_nothing(tmp_path: Path) -> None:
    """Regression: ``<id>.measured.tmp`` was opened through links, so a link planted in the
    recording directory had the server's user overwrite a file of the planter's choosing."""
    rec_dir = tmp_path / "rec"
    rec_dir.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    rid = _fixed_id()
    (rec_dir / f"{rid}.measured.tmp").symlink_to(victim)
    (rec_dir / f"{rid}.measured.json").symlink_to(victim)
    rec = _recorder(tmp_path, clock=lambda: FIXED)
    rec.measured({"hits": 1})
    rec.close()
    assert victim.read_text() == "precious\n"
    measured = rec_dir / f"{rid}.measured.json"
    assert not measured.is_symlink() and json.loads(measured.read_text())["measured"] == {"hits": 1}
    assert rec.disabled is None
    assert [p.name for p in rec_dir.glob("*.tmp") if not p.is_symlink()] == []  # no temp file left behind


def test_a_link_planted_where_a_part_goes_stops_the_recording_not_the_victim(tmp_path: Path, caplog) -> None:
    rec_dir = tmp_path / "rec"
    rec_dir.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (rec_dir / f"{_fixed_id()}-00000.jsonl").symlink_to(victim)
    with caplog.at_level(logging.WARNING, logger="kvstrata.trace.recorder"):
        rec = _recorder(tmp_path, clock=lambda: FIXED)
        rec.admitted("a")
        rec.finished("a", _req(FIXED + 1, [1]))
        rec.close()
    assert victim.read_text() == "precious\n"
    assert rec.disabled is not None
    assert sum("request recording stopped" in r.getMessage() for r in caplog.records) == 1


def test_files_are_private_and_a_directory_others_can_write_is_refused(tmp_path: Path, caplog) -> None:
    import os
    import stat

    rec = _recorder(tmp_path)
    rec.admitted("a")
    rec.finished("a", _req(rec.started + 1, [1]))
    rec.measured({"hits": 1})
    rec.close()
    files = list((tmp_path / "rec").iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files), \
        {f.name: oct(f.stat().st_mode) for f in files}
    assert stat.S_IMODE((tmp_path / "rec").stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with caplog.at_level(logging.WARNING, logger="kvstrata.trace.recorder"):
        bad = TraceRecorder(TraceConfig.from_dict({"path": str(shared), "insecure_hashes": True}), block_size=BS,
                            deployment=_deployment())
        bad.close()
    assert bad.disabled is not None and "others can write" in bad.disabled
    assert list(shared.iterdir()) == []


def test_measurements_are_read_with_a_bound_and_never_from_a_fifo(tmp_path: Path) -> None:
    import os

    from kvstrata.trace.parts import _read_measured

    fifo = tmp_path / "x.measured.json"
    os.mkfifo(fifo)
    assert _read_measured(fifo, "x") is None  # returns at once: never waits for a writer
    link = tmp_path / "y.measured.json"
    link.symlink_to("/dev/zero")
    assert _read_measured(link, "y") is None


def test_without_a_secret_the_recorder_stays_off_unless_plain_hashes_are_asked_for(tmp_path: Path, caplog) -> None:
    """Regression: without a secret (the default) the recorded hashes of a guessed prompt
    matched the recording's, block for block."""
    with caplog.at_level(logging.WARNING, logger="kvstrata.trace.recorder"):
        rec = TraceRecorder(TraceConfig.from_dict({"path": str(tmp_path / "rec")}), block_size=BS,
                            deployment=_deployment())
        rec.admitted("a")
        rec.finished("a", _req(rec.started + 1, [1]))
        rec.measured({"hits": 1})
        rec.close()
    assert rec.disabled is not None and not (tmp_path / "rec").exists()
    assert sum("trace.secret_file" in r.getMessage() for r in caplog.records) == 1
    plain = _recorder(tmp_path / "plain")  # trace.insecure_hashes: true
    plain.admitted("a")
    plain.finished("a", _req(plain.started + 1, [1]))
    plain.close()
    assert _lines(tmp_path / "plain" / "rec")[1]["block_hashes"] == rekey([_key(1)], None)


def test_one_long_request_holds_back_a_bounded_number_of_others(tmp_path: Path, monkeypatch) -> None:
    """Regression: the reorder buffer was unbounded; 100k requests behind one long-running
    one took 317 MiB and none reached the disk."""
    from kvstrata.trace import recorder as recorder_module

    monkeypatch.setattr(recorder_module, "MAX_WAITING", 3)
    rec = _recorder(tmp_path)
    t0 = rec.started
    rec.admitted("slow")
    for i in range(6):
        rec.admitted(f"r{i}")
        rec.finished(f"r{i}", _req(t0 + 1 + i, [10 + i]))
    assert len(rec._pending) <= 3  # bounded: the slow request no longer holds the others back
    rec.finished("slow", _req(t0 + 0.5, [1], finish=t0 + 100))
    rec.close()
    lines = _lines(tmp_path / "rec")[1:]
    assert len(lines) == 7 and rec.counts["late"] == 1
    assert lines[-1].get("late") is True and lines[-1]["block_hashes"] == rekey([_key(1)], None)
    assert not any(line.get("late") for line in lines[:-1])
    assert load_trace(tmp_path / "rec").requests  # still a trace the replay reads


def test_an_inline_recording_secret_is_warned_about_and_never_logged(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="kvstrata.trace.recorder"):
        rec = _recorder(tmp_path, secret="an-inline-recording-secret")
        rec.close()
    lines = [r.getMessage() for r in caplog.records]
    assert any("trace.secret_file" in line for line in lines)
    assert not any("an-inline-recording-secret" in line for line in lines)


def test_forged_measurements_are_read_as_absent_counters_not_a_crash(tmp_path: Path) -> None:
    """The measurements file sits in a directory the deployment writes: a value of the wrong
    kind in it (another tenant's, a hand edit) is a zero counter in the report, never a
    traceback."""
    from kvstrata.cli.commands import main

    rec = _recorder(tmp_path, rotate_bytes="4KiB")
    for i in range(20):
        rec.admitted(str(i))
        rec.finished(str(i), _req(rec.started + i, [i % 5, 50 + i]))
    rec.measured({"queries": 5, "hits": {"gpu": [], "cpu": {"tokens": "7"}}, "spills": "x", "block_nbytes": -3,
                  "preempted": {"hits": {"gpu": None}}, "load": {"block_seconds": [1]}})
    rec.close()
    out = tmp_path / "r.json"
    assert main(["bench", "--trace", str(tmp_path / "rec"), "--json", str(out), "--quiet"]) == 0
    measured = json.loads(out.read_text())["recording"]["measured"]
    assert measured["prompt_tokens"] == 0 and measured["ssd_bytes_written"] == 0
    assert measured["preempted_hit_tokens"] == 0
