"""Damage to a closed SSD tier's index never reaches the process that opens it as a signal.

A fuzz test, bounded in trials: a real tier is filled, thinned (so LMDB's free-page
list has entries) and closed cleanly; each trial copies it, damages its ``data.mdb``
and opens the copy in one real owner process, which then reads every record, writes
new ones (LMDB reads its free list at the first write), reads those back and closes.
Two kinds of damage: the page numbers in a free-list leaf rewritten (what a torn write
or bit rot on that one page leaves; LMDB would hand out pages the B-tree still uses),
and 1 to 8 random bits flipped anywhere in the file. The owner process must exit
normally after every trial and never serve another block's bytes; the tier may lose
records or disable itself.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstrata.tiers.ssd import SSDTier

ROOT = str(Path(__file__).resolve().parents[1])
MiB = 1024**2
FP = "damage/fp16/bs16"
PAGE = 4096
FREE_LIST_TRIALS, BIT_FLIP_TRIALS, RECORDS = 12, 36, 400


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") * 4


def block(i: int) -> bytes:
    rng = np.random.default_rng(i)
    return rng.integers(0, 256, int(rng.integers(512, 12 * 1024)), dtype=np.uint8).tobytes()


def open_tier(path: Path) -> SSDTier:
    return SSDTier(path, capacity_bytes=3 * MiB, fingerprint=FP, compression="none")


def build_base(path: Path) -> None:
    """A cleanly closed tier whose free-page list is not empty."""
    with open_tier(path) as tier:
        for i in range(RECORDS):  # more than fit: the LRU evicts
            assert tier.put(key(i), block(i))
            if i % 40 == 39:
                tier.discard_many([key(j) for j in range(i - 39, i, 3)])
                assert tier.flush()


# ====================================================================== LMDB's layout

def _meta(data: bytearray) -> int:
    """Offset of the current meta page (the one with the higher transaction id)."""
    txn0, txn1 = (struct.unpack_from("<Q", data, at + 144)[0] for at in (0, PAGE))
    return 0 if txn0 >= txn1 else PAGE


def free_list_idls(data: bytearray) -> list[int]:
    """Offsets of the page-number lists (IDLs: a count, then page numbers) in the leaves
    of LMDB's free-page database."""
    root = struct.unpack_from("<Q", data, _meta(data) + 80)[0]
    if root == 2**64 - 1:
        return []
    out: list[int] = []
    stack = [root]
    while stack:
        page = stack.pop() * PAGE
        flags, lower = struct.unpack_from("<HH", data, page + 10)
        for i in range((lower - 16) // 2):
            node = page + struct.unpack_from("<H", data, page + 16 + 2 * i)[0]
            lo, hi, nflags, ksize = struct.unpack_from("<HHHH", data, node)
            if flags & 0x01:  # branch: the child's page number
                stack.append(lo | hi << 16 | nflags << 32)
            elif flags & 0x02:
                at = node + 8 + ksize
                if nflags & 0x01:  # the list lies on an overflow page
                    at = struct.unpack_from("<Q", data, at)[0] * PAGE + 16
                out.append(at)
    return out


def rewrite_free_list(data: bytearray, rng: np.random.Generator) -> None:
    """Page numbers in one free-list leaf replaced by others in the file (in use or not)."""
    last = struct.unpack_from("<Q", data, _meta(data) + 136)[0]
    idls = free_list_idls(data)
    at = idls[int(rng.integers(len(idls)))]
    n = struct.unpack_from("<Q", data, at)[0]
    pages = sorted(rng.integers(3, last + 1, n).tolist(), reverse=True)
    struct.pack_into(f"<{n}Q", data, at + 8, *pages)


def flip_bits(data: bytearray, rng: np.random.Generator) -> None:
    for bit in rng.integers(0, len(data) * 8, int(rng.integers(1, 9))).tolist():
        data[bit // 8] ^= 1 << (bit % 8)


# ====================================================================== the owner process

_OWNER = """
import json, shutil, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import numpy as np
from tests.test_ssd_damage import (RECORDS, block, key, open_tier, rewrite_free_list,
                                   flip_bits)
base, work = Path(sys.argv[2]), Path(sys.argv[3])
for trial, kind in enumerate(json.loads(sys.argv[4])):
    here = work / f"t{trial}"
    shutil.copytree(base, here)
    data = bytearray((here / "data.mdb").read_bytes())
    (rewrite_free_list if kind == "free_list" else flip_bits)(data, np.random.default_rng(trial))
    (here / "data.mdb").write_bytes(data)
    print(json.dumps({"trial": trial, "kind": kind, "opening": True}), flush=True)
    tier = open_tier(here)
    tier.wait_ready(120)
    wrong = hits = 0
    for i, got in enumerate(tier.get_many([key(i) for i in range(RECORDS)])):
        hits += got is not None
        wrong += got is not None and got != block(i)
    fresh = range(10**6 + 100 * trial, 10**6 + 100 * trial + 60)
    for i in fresh:
        tier.put(key(i), block(i))
    tier.flush()
    for i, got in zip(fresh, tier.get_many([key(i) for i in fresh])):
        wrong += got is not None and got != block(i)
    tier.discard_many([key(i) for i in fresh][::2])
    tier.flush()
    available = tier.stats()["available"]
    tier.close()
    shutil.rmtree(here)
    print(json.dumps({"trial": trial, "kind": kind, "wrong": wrong, "hits": hits,
                      "available": available}), flush=True)
"""


@pytest.mark.long
def test_damage_to_a_closed_index_never_signals_the_owner(tmp_path):
    base = tmp_path / "base"
    build_base(base)
    assert free_list_idls(bytearray((base / "data.mdb").read_bytes())), "no free list to damage"
    kinds = ["free_list"] * FREE_LIST_TRIALS + ["bit_flips"] * BIT_FLIP_TRIALS
    (tmp_path / "work").mkdir()
    proc = subprocess.run([sys.executable, "-c", _OWNER, ROOT, str(base), str(tmp_path / "work"),
                           json.dumps(kinds)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    done = [r for r in lines if "wrong" in r]
    at = lines[-1] if lines else None
    assert proc.returncode == 0, (f"the owner process ended with {proc.returncode} in trial "
                                  f"{at}: {proc.stderr[-3000:]}")
    assert len(done) == len(kinds)
    assert sum(r["wrong"] for r in done) == 0, [r for r in done if r["wrong"]]
    # the damage was real: some trials lost records or disabled the tier
    assert any(r["hits"] < max(d["hits"] for d in done) or not r["available"] for r in done)
