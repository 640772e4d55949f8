"""What recovery learns from every head of the index, computed in bulk.

:func:`survey` splits the heads into good records and bad ones, in numpy
rather than a Python step per record: a head is bad when its header does not
verify (length, check, version, codec, lengths), when its body reaches past
the end of ``blocks.dat`` (a torn page file), or when its pages are those of
another record (two heads on one extent keep the one with the lowest key;
of overlapping extents, the one starting first). For the good ones it gives
their page extents (the free-space map is their complement), the bytes they
count against the capacity, and the number of records per namespace.

A :class:`Survey` packs into bytes and back: the integrity check
(:mod:`~kvstrata.tiers.ssd.walk`) runs it in a child process and sends it to
the tier.

Threads: pure functions and immutable results; safe from any thread.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import xxhash

from kvstrata.tiers.ssd.extents import ExtentMap
from kvstrata.tiers.ssd.record import (HEAD_DTYPE, HEADER, MAX_RAW_LEN, NS_LEN, PAGE, PLANES,
                                     RECORD_VERSION, record_footprints)

__all__ = ["Survey", "survey"]

_CHECKED_LEN = HEADER.size - 4   # header bytes covered by its check
_NO_HEADER = bytes(HEADER.size)  # stands in for a head too short to hold one


@dataclass
class Survey:
    """Good records' extents (``starts``, ``npages``: bodies only), the keys of bad
    records, used bytes and records per namespace of the good ones."""

    starts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    npages: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    bad: list[bytes] = field(default_factory=list)
    used: int = 0
    counts: dict[bytes, int] = field(default_factory=dict)

    @property
    def records(self) -> int:
        return sum(self.counts.values())

    def pack(self) -> bytes:
        import msgpack
        return msgpack.packb({"starts": self.starts.astype("<i8").tobytes(),
                              "npages": self.npages.astype("<i8").tobytes(),
                              "bad": self.bad, "used": self.used, "counts": self.counts})

    @classmethod
    def unpack(cls, data: bytes) -> "Survey":
        """Raises ``ValueError`` for anything :meth:`pack` did not write."""
        import msgpack
        try:
            d = msgpack.unpackb(data, strict_map_key=False)
            return cls(np.frombuffer(d["starts"], "<i8").astype(np.int64),
                       np.frombuffer(d["npages"], "<i8").astype(np.int64),
                       [bytes(k) for k in d["bad"]], int(d["used"]),
                       {bytes(k): int(v) for k, v in d["counts"].items()})
        except Exception as exc:
            raise ValueError(f"not a survey: {exc!r}") from None


def survey(nskeys: Sequence[bytes], heads: Sequence[bytes], blocks_size: int) -> Survey:
    """The survey of ``heads`` (of ``nskeys``, in key order) against a page file of
    ``blocks_size`` bytes."""
    n = len(heads)
    if not n:
        return Survey()
    hdr, good = _verified(heads)
    payload = hdr["payload_len"].astype(np.int64)
    body = payload - hdr["tail_len"].astype(np.int64)
    page = hdr["page"]
    torn = (body > 0) & ((page > blocks_size // PAGE) |
                         (page.astype(np.int64) * PAGE + body > blocks_size))
    good &= ~torn
    npages = -(-body // PAGE)
    good &= ~_clashing(page, npages, good)
    keylen = np.fromiter(map(len, nskeys), np.int64, n)
    idx = np.flatnonzero(good)
    kept = [nskeys[i] for i in idx.tolist()]
    used = int(record_footprints(keylen[idx], payload[idx]).sum())
    with_body = idx[npages[idx] > 0]
    return Survey(page[with_body].astype(np.int64), npages[with_body],
                  [nskeys[i] for i in np.flatnonzero(~good).tolist()], used, _counts(kept))


def _verified(heads: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """The headers of ``heads`` as a structured array, and which of them verify."""
    n = len(heads)
    lengths = np.fromiter(map(len, heads), np.int64, n)
    joined = b"".join(heads)
    if len(joined) != n * HEADER.size:  # some carry tails (or are too short)
        joined = b"".join(h[:HEADER.size] if len(h) >= HEADER.size else _NO_HEADER
                          for h in heads)
    hdr = np.frombuffer(joined, HEAD_DTYPE)
    view = memoryview(joined)
    step, digest = HEADER.size, xxhash.xxh32_intdigest
    checks = np.fromiter((digest(view[i:i + _CHECKED_LEN]) for i in range(0, n * step, step)),
                         np.uint32, n)
    tail = hdr["tail_len"].astype(np.int64)
    payload = hdr["payload_len"].astype(np.int64)
    good = ((lengths >= HEADER.size) & (checks == hdr["check"])
            & (hdr["version"] == RECORD_VERSION) & (hdr["codec"] <= PLANES)
            & (np.maximum(hdr["raw_len"], hdr["payload_len"]) <= MAX_RAW_LEN)
            & (tail <= payload) & (lengths == HEADER.size + tail))
    return hdr, good


def _clashing(page: np.ndarray, npages: np.ndarray, good: np.ndarray) -> np.ndarray:
    """Good records whose pages another good record holds: of two on one extent, the
    later key; of overlapping extents, the one starting later (the earlier one ends
    where the next kept one may start)."""
    clash = np.zeros(len(page), dtype=bool)
    idx = np.flatnonzero(good & (npages > 0))
    if not len(idx):
        return clash
    start = page[idx].astype(np.int64)
    order = np.lexsort((idx, npages[idx], start))  # by start, length, then key order
    s, e = start[order], start[order] + npages[idx][order]
    if not (s[1:] < np.maximum.accumulate(e)[:-1]).any():
        return clash  # the usual case: every extent apart
    _clashing_exactly(clash, idx, start, npages[idx])
    return clash


def _clashing_exactly(clash: np.ndarray, idx: np.ndarray, start: np.ndarray,
                      npages: np.ndarray) -> None:
    """Mark in ``clash`` what :func:`_clashing` finds, one record at a time (only when
    some extents do clash)."""
    owner: dict[tuple[int, int], int] = {}
    for i, p, n in zip(idx.tolist(), start.tolist(), npages.tolist()):
        if owner.setdefault((p, n), i) != i:
            clash[i] = True  # a second head on one extent
    extents = sorted(owner)
    for extent in ExtentMap.overlapping(extents):
        clash[owner[extent]] = True


def _counts(nskeys: list[bytes]) -> dict[bytes, int]:
    """Records per namespace prefix of sorted keys (one range per namespace)."""
    counts: dict[bytes, int] = {}
    i = 0
    while i < len(nskeys):
        ns = nskeys[i][:NS_LEN]
        j = i + 1 if len(ns) < NS_LEN else bisect.bisect_left(nskeys, _after(ns), i)
        counts[ns] = counts.get(ns, 0) + j - i
        i = j
    return counts


def _after(prefix: bytes) -> bytes:
    """The smallest key above every key that starts with ``prefix``."""
    value = int.from_bytes(prefix, "big") + 1
    return value.to_bytes(len(prefix), "big") if value >> (8 * len(prefix)) == 0 else b"\xff" * 512
