"""The SSD tier's record format: a fixed header and a (compressed) payload.

A record is stored in two places so that page rounding never carries the header:

* the *head*, a small index value: :data:`HEADER` (44 bytes) followed by an
  optional *tail*, the last few bytes of the payload that would otherwise take
  one more 4 KiB page (see :func:`split_tail`);
* the *body*, the rest of the payload: whole pages of the page file, starting
  at the page number in the header.

Header fields (little endian): format version, codec, reserved, raw length,
payload length, tail length, ``xxh3_64`` of the raw block (seeded with a hash
of the namespaced key, so a record can never verify under another key),
access clock, first page of the body in the page file, and ``xxh32`` of all
preceding header bytes.

Codecs:

* ``RAW``: the block as is;
* ``ZSTD``: the whole block through zstd;
* ``PLANES``: the block read as 16-bit little-endian words, split into a
  high-byte plane (sign, exponent, top mantissa bits: compressible) and a
  low-byte plane (mantissa noise: stored raw). Payload = ``u32`` compressed
  high-plane length, compressed high plane, raw low plane.

Keys are stored under a :data:`NS_LEN`-byte namespace prefix derived from the
record version and the fingerprint (:func:`namespace_of`). What a record
costs against the tier's capacity is :func:`record_footprint`, the one rule
the writer enforces and :func:`capacity_blocks` inverts.

Threads: everything here is immutable or per call, except :class:`Codec`,
whose zstd contexts are not thread-safe: each thread gets its own, kept in
thread-local storage, so one :class:`Codec` is shared by the writer thread,
the codec threads and every reading thread without a lock.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvstrata.identity.fingerprint import RECORD_VERSION
from kvstrata.tiers.ssd.footprint import (CLOCK, HEADER, NS_LEN, PAGE, TAIL_MAX, _NODE, body_pages,
                                           capacity_blocks, record_footprint, split_tail)

__all__ = [
    "RECORD_VERSION", "RAW", "ZSTD", "PLANES", "HEADER", "PAGE", "NS_LEN", "CLOCK", "Header",
    "Codec", "Encoded", "CorruptRecord", "checksum", "split_tail", "body_pages",
    "record_footprint", "record_footprints", "capacity_blocks", "namespace_of", "COMPRESSIONS",
    "pack_header", "HEAD_DTYPE",
]

RAW, ZSTD, PLANES = 0, 1, 2
COMPRESSIONS = ("auto", "zstd", "none")

# version, codec, reserved, raw_len, payload_len, tail_len, checksum, clock, page, header_check
_CHECKED = struct.Struct("<BBHIIIQQQ")
HEAD_DTYPE = np.dtype([("version", "u1"), ("codec", "u1"), ("reserved", "<u2"),  # HEADER in numpy
                       ("raw_len", "<u4"), ("payload_len", "<u4"), ("tail_len", "<u4"),
                       ("checksum", "<u8"), ("clock", "<u8"), ("page", "<u8"), ("check", "<u4")])
_U32 = struct.Struct("<I")
_CLOCK_AT = struct.calcsize("<BBHIIIQ")  # offset of the clock field in HEADER

MAX_RAW_LEN = 1 << 31   # sanity bound checked before allocating for a record


class CorruptRecord(Exception):
    """A stored record does not verify; the caller deletes it and reports a miss."""


def checksum(nskey: bytes, raw: Any) -> int:
    """``xxh3_64`` of ``raw`` seeded by a hash of the namespaced key."""
    return xxhash.xxh3_64_intdigest(raw, seed=xxhash.xxh3_64_intdigest(nskey))








def record_footprints(key_lens: np.ndarray, payload_lens: np.ndarray) -> np.ndarray:
    """:func:`record_footprint` of many records at once (``int64`` arrays)."""
    tail = payload_lens % PAGE
    tail = np.where(tail <= TAIL_MAX, tail, 0)
    body_pages = -(-(payload_lens - tail) // PAGE)
    return (body_pages * PAGE + (key_lens + HEADER.size + tail + _NODE)
            + (CLOCK.size + key_lens + _NODE))




def namespace_of(fingerprint: bytes) -> bytes:
    """The :data:`NS_LEN`-byte key prefix of a fingerprint (changes with the record version)."""
    return hashlib.blake2b(b"kvstrata/%d/" % RECORD_VERSION + fingerprint,
                           digest_size=NS_LEN).digest()


@dataclass(frozen=True, slots=True)
class Header:
    """A decoded, self-checked record header."""

    codec: int
    raw_len: int
    payload_len: int
    tail_len: int
    checksum: int
    clock: int
    page: int = 0

    @property
    def pages(self) -> int:
        """Pages of the block file holding the body."""
        return body_pages(self.payload_len, self.tail_len)

    def pack(self) -> bytes:
        return pack_header(self.codec, self.raw_len, self.payload_len, self.tail_len,
                           self.checksum, self.clock, self.page)

    @classmethod
    def unpack(cls, head: bytes) -> "Header":
        """Parse and verify a head record; raise :class:`CorruptRecord` if it does not verify."""
        if len(head) < HEADER.size:
            raise CorruptRecord(f"head record of {len(head)} bytes")
        version, codec, _, raw_len, payload_len, tail_len, csum, clock, page, check = \
            HEADER.unpack_from(head)
        if xxhash.xxh32_intdigest(head[:_CHECKED.size]) != check:
            raise CorruptRecord("header check mismatch")
        if version != RECORD_VERSION or codec not in (RAW, ZSTD, PLANES):
            raise CorruptRecord(f"unknown record version {version} / codec {codec}")
        if (max(raw_len, payload_len) > MAX_RAW_LEN or tail_len > payload_len
                or len(head) != HEADER.size + tail_len):
            raise CorruptRecord("inconsistent lengths in header")
        return cls(codec, raw_len, payload_len, tail_len, csum, clock, page)

    @staticmethod
    def clock_of(head: Any) -> int:
        """The access clock field of a packed header, read without verifying anything."""
        return int.from_bytes(head[_CLOCK_AT:_CLOCK_AT + 8], "little")

    def with_clock(self, clock: int) -> "Header":
        return Header(self.codec, self.raw_len, self.payload_len, self.tail_len, self.checksum,
                      clock, self.page)

    def at_page(self, page: int) -> "Header":
        return Header(self.codec, self.raw_len, self.payload_len, self.tail_len, self.checksum,
                      self.clock, page)


class Codec:
    """Encodes blocks for storage and decodes them back; safe to share across threads.

    ``compression``: ``"none"`` stores raw; ``"zstd"`` stores the smaller of the
    byte-plane and whole-block encodings; ``"auto"`` tries the byte-plane split
    (whole-block zstd for odd lengths) and stores raw unless the payload is at
    least ``min_gain`` smaller than the block.
    """

    def __init__(self, compression: str = "auto", level: int = 1, min_gain: float = 0.05) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression: expected one of {COMPRESSIONS}, got {compression!r}")
        if isinstance(level, bool) or not isinstance(level, int) or not -7 <= level <= 22:
            raise ValueError(f"level: expected a zstd level in [-7, 22], got {level!r}")
        self.compression = compression
        self.level = level
        self.min_gain = min_gain
        self._local = threading.local()

    # ------------------------------------------------------------------ thread-local zstd

    def _cctx(self) -> Any:
        cctx = getattr(self._local, "cctx", None)
        if cctx is None:
            import zstandard
            cctx = self._local.cctx = zstandard.ZstdCompressor(
                level=self.level, write_content_size=False, write_checksum=False)
        return cctx

    def _dctx(self) -> Any:
        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            import zstandard
            dctx = self._local.dctx = zstandard.ZstdDecompressor()
        return dctx

    # ------------------------------------------------------------------ encode

    def encode(self, raw: bytes | bytearray) -> tuple[int, bytes | bytearray]:
        """Return ``(codec, payload)`` for one block."""
        if self.compression == "none" or not raw:
            return RAW, raw
        candidates = [self._planes(raw)] if len(raw) % 2 == 0 else []
        if self.compression == "zstd" or not candidates:
            candidates.append((ZSTD, self._cctx().compress(raw)))
        codec, payload = min(candidates, key=lambda c: len(c[1]))
        if self.compression == "auto" and len(payload) > len(raw) * (1.0 - self.min_gain):
            return RAW, raw
        return codec, payload

    def _planes(self, raw: bytes | bytearray) -> tuple[int, bytes]:
        words = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 2)
        high = self._cctx().compress(np.ascontiguousarray(words[:, 1]))
        low = np.ascontiguousarray(words[:, 0])
        return PLANES, b"".join((_U32.pack(len(high)), high, low.data))

    # ------------------------------------------------------------------ decode

    def decode(self, codec: int, payload: bytes, raw_len: int,
               into: memoryview | None = None) -> Any:
        """Invert :meth:`encode`; raise :class:`CorruptRecord` on any inconsistency.

        Returns the block as ``bytes``, or writes it into ``into`` (a writable
        byte view of ``raw_len`` bytes) and returns ``into``: byte-plane records
        are then interleaved straight into it, with no intermediate block.
        """
        if into is not None and len(into) != raw_len:
            raise ValueError(f"into: {len(into)} bytes for a block of {raw_len}")
        try:
            if codec == PLANES:
                raw = self._unplanes(payload, raw_len, into)
            else:
                raw = payload if codec == RAW else self._decompress(payload, raw_len)
                if into is not None and raw is not into and len(raw) == raw_len:
                    into[:] = raw
                    raw = into
        except CorruptRecord:
            raise
        except Exception as exc:  # zstd reports damaged frames with its own error types
            raise CorruptRecord(f"payload does not decode: {exc}") from exc
        if len(raw) != raw_len:
            raise CorruptRecord(f"decoded {len(raw)} bytes, header says {raw_len}")
        return raw

    def _decompress(self, frame: Any, size: int) -> bytes:
        import zstandard
        declared = zstandard.frame_content_size(frame)
        if declared > size:  # a damaged frame must not make us allocate its claim
            raise CorruptRecord(f"zstd frame declares {declared} bytes, expected {size}")
        return self._dctx().decompress(frame, max_output_size=size)

    def _unplanes(self, payload: bytes, raw_len: int, into: memoryview | None) -> Any:
        if raw_len % 2 or len(payload) < _U32.size:
            raise CorruptRecord("byte-plane record of odd length")
        (hlen,) = _U32.unpack_from(payload)
        half = raw_len // 2
        if _U32.size + hlen + half != len(payload):
            raise CorruptRecord("byte-plane lengths do not add up")
        view = memoryview(payload)
        high = self._decompress(view[_U32.size:_U32.size + hlen], half)
        if len(high) != half:
            raise CorruptRecord("high plane has the wrong length")
        out = np.empty((half, 2), dtype=np.uint8) if into is None else \
            np.frombuffer(into, dtype=np.uint8).reshape(half, 2)
        out[:, 0] = np.frombuffer(view[_U32.size + hlen:], dtype=np.uint8)
        out[:, 1] = np.frombuffer(high, dtype=np.uint8)
        return out.tobytes() if into is None else into


class Encoded:
    """A block ready to be written: its header fields (``page`` assigned by the writer),
    body, tail and footprint."""

    __slots__ = ("nskey", "codec", "raw_len", "payload_len", "tail_len", "checksum", "page",
                 "pages", "body", "tail", "footprint", "tag")

    def __init__(self, nskey: bytes, raw: bytes | bytearray, codec: Codec, tag: bytes | None = None) -> None:
        kind, payload = codec.encode(raw)
        size = len(payload)
        ntail = split_tail(size)
        self.nskey = nskey
        self.codec = kind
        self.raw_len = len(raw)
        self.payload_len = size
        self.tail_len = ntail
        self.checksum = checksum(nskey, raw)
        self.page = 0
        self.pages = -(-(size - ntail) // PAGE)
        if ntail:
            view = memoryview(payload)
            self.body = view[:size - ntail]
            self.tail = bytes(view[size - ntail:])
        else:
            self.body = payload
            self.tail = b""
        self.footprint = record_footprint(len(nskey), size)
        self.tag = tag

    @property
    def header(self) -> Header:
        """The header (clock 0); assigning one sets the fields it carries (its page)."""
        return Header(self.codec, self.raw_len, self.payload_len, self.tail_len, self.checksum,
                      0, self.page)

    @header.setter
    def header(self, hdr: Header) -> None:
        self.codec, self.raw_len, self.payload_len = hdr.codec, hdr.raw_len, hdr.payload_len
        self.tail_len, self.checksum, self.page = hdr.tail_len, hdr.checksum, hdr.page

    def head(self, clock: int) -> bytes:
        """The head entry stored in the index, stamped with ``clock``."""
        return pack_header(self.codec, self.raw_len, self.payload_len, self.tail_len,
                           self.checksum, clock, self.page) + self.tail


def pack_header(codec: int, raw_len: int, payload_len: int, tail_len: int, csum: int,
                clock: int, page: int) -> bytes:
    """:data:`HEADER` of these fields, with its check."""
    fields = _CHECKED.pack(RECORD_VERSION, codec, 0, raw_len, payload_len, tail_len, csum,
                           clock, page)
    return fields + _U32.pack(xxhash.xxh32_intdigest(fields))
