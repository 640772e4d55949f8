"""``kvstrata ssd stats | verify`` on real tiers: what they report, what they refuse, and that
nothing on disk changes (not a byte, not a lock file)."""

from __future__ import annotations

import hashlib
import json
import re
import os
from pathlib import Path

import lmdb
import msgpack
import numpy as np
import pytest

from kvstrata.cli.commands import main
from kvstrata.identity.fingerprint import RECORD_VERSION
from kvstrata.tiers.ssd import SSDTier

BLOCK = 64 * 1024


def fill(path: Path, n: int = 40, fingerprint: str = "model-a|fp16|tp0") -> SSDTier:
    tier = SSDTier(path, capacity_bytes=64 * 1024**2, fingerprint=fingerprint, block_nbytes=BLOCK)
    rng = np.random.default_rng(1)
    for i in range(n):
        assert tier.put(i.to_bytes(32, "big"), rng.standard_normal(BLOCK // 2).astype(np.float16).view(np.uint8))
    assert tier.flush()
    return tier


def snapshot(path: Path) -> dict[str, tuple[str, int]]:
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mode)
            for p in sorted(path.iterdir()) if p.is_file()}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_stats_and_verify_of_a_sound_tier_change_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fill(tmp_path / "t").close()
    fill(tmp_path / "t", 10, "model-b|bf16|tp0").close()  # a second model's namespace in the same directory
    before = snapshot(tmp_path / "t")
    rc, out, _ = run(capsys, "ssd", "stats", str(tmp_path / "t"), "--json", str(tmp_path / "s.json"))
    assert rc == 0 and re.search(r"records +50\n", out) and "model-a|fp16|tp0" in out and "model-b|bf16|tp0" in out
    (report,) = json.loads((tmp_path / "s.json").read_text())["tiers"]
    assert report["records"] == 50 and report["logical_bytes"] == 50 * BLOCK
    assert report["stored_bytes"] < report["logical_bytes"]  # fp16 KV compresses a little
    assert {ns["fingerprint"]: ns["records"] for ns in report["namespaces"]} == {"model-a|fp16|tp0": 40,
                                                                               "model-b|bf16|tp0": 10}
    rc, out, _ = run(capsys, "ssd", "verify", str(tmp_path / "t"))
    assert rc == 0 and "verify: 50 records read, 0 bad records" in out
    assert snapshot(tmp_path / "t") == before


def test_verify_finds_flipped_bytes_and_changes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fill(tmp_path / "t").close()
    blocks = tmp_path / "t" / "blocks.dat"
    data = bytearray(blocks.read_bytes())
    for at in (100, 120_000, 300_000):  # in the bodies of three records (~56 KiB each)
        data[at] ^= 0x40
    blocks.write_bytes(bytes(data))
    before = snapshot(tmp_path / "t")
    rc, out, _ = run(capsys, "ssd", "verify", str(tmp_path / "t"), "--json", "-")
    assert rc == 1  # bad records found
    (report,) = json.loads(out)["tiers"]
    assert report["verify"]["checked"] == 40 and report["verify"]["bad"] == 3
    assert set(report["verify"]["bad_by_reason"]) <= {"checksum", "payload"}
    assert snapshot(tmp_path / "t") == before


def test_a_tier_held_by_a_server_is_read_but_not_verified(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tier = fill(tmp_path / "t")
    try:
        rc, out, _ = run(capsys, "ssd", "stats", str(tmp_path / "t"))
        assert rc == 0 and f"(in use by process {os.getpid()})" in out and re.search(r"records +40\n", out)
        rc, _, err = run(capsys, "ssd", "verify", str(tmp_path / "t"))
        assert rc == 2 and err.count("\n") == 1 and f"in use by process {os.getpid()}" in err
        assert tier.get((3).to_bytes(32, "big")) is not None  # the owner never noticed
    finally:
        tier.close()


def test_a_vllm_ssd_path_reports_each_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "root").mkdir()
    for rank, n in ((0, 12), (1, 7)):
        fill(tmp_path / "root" / f"rank-{rank}", n, f"m|tp{rank}").close()
    rc, out, _ = run(capsys, "ssd", "stats", str(tmp_path / "root"), "--json", "-")
    assert rc == 0 and [t["records"] for t in json.loads(out)["tiers"]] == [12, 7]


def test_an_sglang_ssd_path_reports_each_pools_tiers_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A hybrid model under SGLang keeps an extra pool's tiers under ``pool-<name>/rank-<r>``;
    a ``pool-*`` link someone planted is not followed."""
    root = tmp_path / "root"
    (root / "pool-mamba").mkdir(parents=True)
    fill(root / "rank-0", 12, "m|tp0").close()
    fill(root / "pool-mamba" / "rank-0", 5, "m|mamba|tp0").close()
    fill(tmp_path / "elsewhere", 3, "other").close()
    (root / "pool-planted").symlink_to(tmp_path / "elsewhere")
    rc, out, _ = run(capsys, "ssd", "stats", str(root), "--json", "-")
    tiers = json.loads(out)["tiers"]
    assert rc == 0 and [(Path(t["path"]).relative_to(root).as_posix(), t["records"]) for t in tiers] == [
        ("rank-0", 12), ("pool-mamba/rank-0", 5)]


def _set_format(path: Path, version: int) -> None:
    env = lmdb.open(str(path), max_dbs=8)
    with env.begin(write=True) as txn:
        meta = env.open_db(b"meta", txn=txn)
        info = msgpack.unpackb(txn.get(b"kvstrata", db=meta))
        txn.put(b"kvstrata", msgpack.packb({**info, "format": version}), db=meta)
    env.close()
    (path / "lock.mdb").unlink(missing_ok=True)


def test_other_formats_and_other_directories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fill(tmp_path / "old").close()
    _set_format(tmp_path / "old", RECORD_VERSION - 1)
    rc, out, _ = run(capsys, "ssd", "stats", str(tmp_path / "old"))
    assert rc == 0 and f"record format {RECORD_VERSION - 1}: older than this kvstrata's" in out
    fill(tmp_path / "new").close()
    _set_format(tmp_path / "new", RECORD_VERSION + 1)
    before = snapshot(tmp_path / "new")
    for command in ("stats", "verify"):
        rc, _, err = run(capsys, "ssd", command, str(tmp_path / "new"))
        assert rc == 2 and f"written by a newer kvstrata (record format {RECORD_VERSION + 1})" in err
        assert err.count("\n") == 1 and "Traceback" not in err
    assert snapshot(tmp_path / "new") == before
    (tmp_path / "plain").mkdir()
    rc, _, err = run(capsys, "ssd", "stats", str(tmp_path / "plain"))
    assert rc == 2 and "not an SSD tier (no data.mdb)" in err
    foreign = tmp_path / "foreign"
    env = lmdb.open(str(foreign), max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(b"key", b"someone else's value")
    env.close()
    rc, _, err = run(capsys, "ssd", "stats", str(foreign))
    assert rc == 2 and err.startswith("kvstrata: error: ") and err.count("\n") == 1
    rc, _, err = run(capsys, "ssd", "stats", str(tmp_path / "missing"))
    assert rc == 2 and "no such directory" in err


def blocks_of(n: int) -> list[bytes]:
    rng = np.random.default_rng(1)
    return [rng.standard_normal(BLOCK // 2).astype(np.float16).view(np.uint8).tobytes() for _ in range(n)]


def test_verify_drop_deletes_exactly_the_bad_records(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fill(tmp_path / "t").close()
    blocks = tmp_path / "t" / "blocks.dat"
    data = bytearray(blocks.read_bytes())
    for at in (100, 120_000):
        data[at] ^= 0x40
    blocks.write_bytes(bytes(data))
    rc, out, _ = run(capsys, "ssd", "verify", str(tmp_path / "t"), "--drop")
    assert rc == 0 and "2 bad records (2 checksum); deleted 2" in out
    rc, out, _ = run(capsys, "ssd", "verify", str(tmp_path / "t"))
    assert rc == 0 and "verify: 38 records read, 0 bad records" in out
    tier = SSDTier(tmp_path / "t", capacity_bytes=64 * 1024**2, fingerprint="model-a|fp16|tp0", block_nbytes=BLOCK)
    try:
        want = blocks_of(40)
        kept = {int.from_bytes(k, "big") for k in tier.keys()}
        assert len(kept) == 38 and all(tier.get(i.to_bytes(32, "big")) == want[i] for i in kept)
    finally:
        tier.close()


def test_purge_deletes_one_namespace_and_is_refused_while_a_server_holds_the_tier(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fill(tmp_path / "t").close()
    fill(tmp_path / "t", 10, "model-old").close()
    held = fill(tmp_path / "t", 0)
    before = snapshot(tmp_path / "t")
    rc, _, err = run(capsys, "ssd", "purge", str(tmp_path / "t"), "--namespace", "model-old")
    assert rc == 2 and err.count("\n") == 1 and "is in use by this process" in err
    held.close()
    assert snapshot(tmp_path / "t")["blocks.dat"] == before["blocks.dat"]
    rc, out, _ = run(capsys, "ssd", "purge", str(tmp_path / "t"), "--namespace", "model-old")
    assert rc == 0 and "deleted 10 records of" in out and "(model-old)" in out
    rc, out, _ = run(capsys, "ssd", "stats", str(tmp_path / "t"), "--json", "-")
    counts = {ns["fingerprint"]: ns["records"] for ns in json.loads(out)["tiers"][0]["namespaces"]}
    assert counts == {"model-a|fp16|tp0": 40, "model-old": 0}
    rc, _, err = run(capsys, "ssd", "purge", str(tmp_path / "t"), "--namespace", "nothing-like-it")
    assert rc == 2 and "matches none of" in err and "model-a|fp16|tp0" in err


def test_purge_older_than_deletes_what_was_unused_that_long(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's time marks date each record's last use to the minute: records written two
    hours ago and not used since go; one read since then and the new ones stay. (The two hours
    are the writer's clock moved back: a test cannot wait them out.)"""
    from kvstrata.tiers.ssd import writer

    real = writer.wall_clock
    monkeypatch.setattr(writer, "wall_clock", lambda: real() - 7200)
    fill(tmp_path / "t", 10).close()
    monkeypatch.setattr(writer, "wall_clock", real)
    tier = SSDTier(tmp_path / "t", capacity_bytes=64 * 1024**2, fingerprint="model-a|fp16|tp0", block_nbytes=BLOCK)
    try:
        assert tier.get((3).to_bytes(32, "big")) == blocks_of(10)[3]  # a use: now recent
        for i in range(100, 105):
            assert tier.put(i.to_bytes(32, "big"), bytes([i]) * BLOCK)
        assert tier.flush()
    finally:
        tier.close()
    rc, out, _ = run(capsys, "ssd", "stats", str(tmp_path / "t"), "--json", "-")
    (report,) = json.loads(out)["tiers"]
    assert 7100 < report["idle_at_least_s"]["max"] < 7300 and report["idle_at_least_s"]["p50"] > 7000
    rc, out, _ = run(capsys, "ssd", "purge", str(tmp_path / "t"), "--older-than", "1h")
    assert rc == 0 and "deleted 9 records unused for at least 3,600 s" in out
    tier = SSDTier(tmp_path / "t", capacity_bytes=64 * 1024**2, fingerprint="model-a|fp16|tp0", block_nbytes=BLOCK)
    try:
        assert sorted(int.from_bytes(k, "big") for k in tier.keys()) == [3, 100, 101, 102, 103, 104]
    finally:
        tier.close()
    with pytest.raises(SystemExit) as exit_:
        main(["ssd", "purge", str(tmp_path / "t"), "--older-than", "soon"])
    assert exit_.value.code == 2 and "expected a duration such as 30m, 12h or 7d" in capsys.readouterr().err


def test_purge_all_but_keeps_the_current_models_namespace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for fp, n in (("model-a|fp16|tp0", 6), ("model-old-1", 4), ("model-old-2", 3)):
        fill(tmp_path / "t", n, fp).close()
    rc, out, _ = run(capsys, "ssd", "purge", str(tmp_path / "t"), "--all-but", "model-a|fp16|tp0")
    assert rc == 0 and "deleted 4 records" in out and "deleted 3 records" in out and "model-a" not in out
    rc, out, _ = run(capsys, "ssd", "stats", str(tmp_path / "t"), "--json", "-")
    counts = {ns["fingerprint"]: ns["records"] for ns in json.loads(out)["tiers"][0]["namespaces"]}
    assert counts == {"model-a|fp16|tp0": 6, "model-old-1": 0, "model-old-2": 0}
    rc, _, err = run(capsys, "ssd", "purge", str(tmp_path / "t"), "--all-but", "model-b")
    assert rc == 2 and "--all-but model-b: matches none" in err


def test_verify_without_a_readable_page_file_is_an_error_not_a_clean_bill(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    fill(tmp_path / "t", 5).close()
    (tmp_path / "t" / "blocks.dat").rename(tmp_path / "blocks.dat")
    rc, out, err = run(capsys, "ssd", "verify", str(tmp_path / "t"), "--drop")
    assert rc == 2 and err == f"kvstrata: error: {tmp_path / 't'}: cannot read the tier: cannot open blocks.dat " \
                              "for reading\n" and "0 bad records" not in out
