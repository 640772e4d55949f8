"""What the project's releases under its previous name left on disk.

``data/previous_ssd_tier.tar.gz`` is an SSD tier directory written by the last
release under that name (8 blocks of 4 KiB, closed cleanly). kvstrata refuses
it with one line naming the format that wrote it and the way out, changes
nothing in it, and ``kvstrata ssd purge --all`` clears it. Traces written under
the previous header key are read as before.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from kvstrata.cli.commands import main
from kvstrata.errors import ConfigError
from kvstrata.identity.fingerprint import PREVIOUS_NAME, RECORD_VERSION
from kvstrata.tiers.ssd import SSDTier
from kvstrata.trace.format import HEADER_KEY, PREVIOUS_HEADER_KEY, TRACE_VERSION
from kvstrata.trace.reader import load_trace

DATA = Path(__file__).parent / "data"


@pytest.fixture
def previous(tmp_path: Path) -> Path:
    with tarfile.open(DATA / "previous_ssd_tier.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    return tmp_path / "tier"


def snapshot(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def open_tier(path: Path) -> SSDTier:
    return SSDTier(path, capacity_bytes=4 * 1024**2, fingerprint=b"previous-release-fixture", block_nbytes=4096)


def test_the_fixture_is_a_previous_release_tier(previous: Path) -> None:
    assert {f"{PREVIOUS_NAME}.lock", f"{PREVIOUS_NAME}.clean", "data.mdb", "blocks.dat"} <= set(os.listdir(previous))


def test_a_previous_tier_is_refused_in_one_line_and_left_as_it_was(previous: Path) -> None:
    before = snapshot(previous)
    with pytest.raises(ConfigError) as err:
        open_tier(previous)
    msg = str(err.value)
    assert "\n" not in msg
    assert f"written by {PREVIOUS_NAME}" in msg and "record format 2" in msg and f"format {RECORD_VERSION}" in msg
    assert f"kvstrata ssd purge --all {previous}" in msg
    assert snapshot(previous) == before


def test_without_its_lock_and_snapshot_files_it_is_still_recognised(previous: Path) -> None:
    """Only data.mdb says who wrote it: the read-only child finds the previous meta record."""
    os.unlink(previous / f"{PREVIOUS_NAME}.lock")
    os.unlink(previous / f"{PREVIOUS_NAME}.clean")
    before = snapshot(previous)
    with pytest.raises(ConfigError, match=r"written by .*record format 2\).*purge --all"):
        open_tier(previous)
    assert snapshot(previous) == before


def test_the_cli_refuses_stats_then_purge_all_clears_it(previous: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ssd", "stats", str(previous)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "purge --all" in err and "Traceback" not in err
    assert main(["ssd", "purge", str(previous), "--all"]) == 0
    assert "deleted every block" in capsys.readouterr().out
    assert os.listdir(previous) == []
    tier = open_tier(previous)  # a new tier of this format, empty, that stores and serves
    try:
        assert list(tier.keys()) == []
        tier.put(b"k" * 32, np.full(4096, 7, dtype=np.uint8))
        assert tier.flush()
        assert bytes(tier.get(b"k" * 32)) == bytes([7]) * 4096
    finally:
        tier.close()
    assert main(["ssd", "stats", str(previous)]) == 0


def test_purge_all_leaves_files_it_does_not_know(previous: Path) -> None:
    (previous / "notes.txt").write_text("operator's")
    assert main(["ssd", "purge", str(previous), "--all"]) == 0
    assert os.listdir(previous) == ["notes.txt"]


def test_purge_all_waits_for_a_server_of_the_previous_name_to_stop(previous: Path) -> None:
    """A process holding the previous lock file (a server of the previous release) keeps
    its directory: purge deletes nothing."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(previous / f'{PREVIOUS_NAME}.lock')!r}, os.O_RDWR)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        before = snapshot(previous)
        with pytest.raises(ConfigError, match=f"in use by another process .*{PREVIOUS_NAME}.lock"):
            from kvstrata.tiers.ssd.admin import purge_all
            purge_all(previous)
        assert snapshot(previous).keys() >= before.keys() and all(
            snapshot(previous)[n] == h for n, h in before.items())
    finally:
        holder.kill()
        holder.wait()
    fd = os.open(previous / f"{PREVIOUS_NAME}.lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nothing of ours still holds it
    finally:
        os.close(fd)


def test_a_trace_with_the_previous_header_key_is_read(tmp_path: Path) -> None:
    rows = [{"timestamp": i, "block_hashes": [1, 2, 3 + i]} for i in range(3)]
    old = tmp_path / "old.jsonl"
    old.write_text("\n".join(json.dumps(r) for r in [{PREVIOUS_HEADER_KEY: 2, "block_size": 16}, *rows]) + "\n")
    new = tmp_path / "new.jsonl"
    new.write_text("\n".join(json.dumps(r) for r in [{HEADER_KEY: TRACE_VERSION, "block_size": 16}, *rows]) + "\n")
    a, b = load_trace(old), load_trace(new)
    assert a.format == b.format == "kvstrata"
    assert [r.blocks for r in a.requests] == [r.blocks for r in b.requests]
    assert PREVIOUS_HEADER_KEY != HEADER_KEY
