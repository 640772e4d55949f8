"""The remote tier's keys and values.

Key: ``kvstrata:<namespace hex>:`` + the block key (32 bytes, binary). The
namespace is the SSD tier's (:func:`~kvstrata.tiers.ssd.record.namespace_of` of a
shard's tier id): two replicas of one checkpoint and layout share keys,
different checkpoints, layouts, TP ranks or record versions never do, and an
operator can list or delete kvstrata's keys by prefix.

Value: the SSD record header (:data:`~kvstrata.tiers.ssd.record.HEADER`, with no
tail and page 0) followed by the payload, encoded by the SSD tier's
:class:`~kvstrata.tiers.ssd.record.Codec`. The checksum is seeded with the whole
key, so a value never verifies under another key. Anything that does not
verify (another tool's bytes, a truncated value, another block size) is
:class:`~kvstrata.tiers.ssd.record.CorruptRecord`: a miss for the caller.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstrata.tiers.ssd.record import HEADER, RAW, Codec, CorruptRecord, Header, checksum, namespace_of, pack_header

__all__ = ["PREFIX", "key_prefix", "encode", "staged", "seal", "decode_into", "value_bytes"]

PREFIX = b"kvstrata:"


def key_prefix(tier_id: str) -> bytes:
    """The prefix of every key of one shard (a :meth:`Fingerprint.tier_id`)."""
    return PREFIX + namespace_of(tier_id.encode()).hex().encode() + b":"


def value_bytes(block_nbytes: int) -> int:
    """The largest value of a block (raw payload): what a pipeline's bytes are counted in."""
    return HEADER.size + block_nbytes


def encode(nskey: bytes, raw: Any, codec: Codec) -> bytes:
    """The value stored under ``nskey`` for the block ``raw`` (bytes-like)."""
    kind, payload = codec.encode(raw)
    head = pack_header(kind, len(raw), len(payload), 0, checksum(nskey, raw), 0, 0)
    return b"".join((head, payload))


def staged(row: Any, buf: bytearray | None = None) -> bytearray:
    """A copy of ``row`` with room for the header in front (into ``buf`` when it has the
    right size: a recycled buffer costs no page faults): what :func:`seal` turns into a
    value without copying the block again."""
    nbytes = int(getattr(row, "nbytes", len(row)))
    if buf is None or len(buf) != HEADER.size + nbytes:
        buf = bytearray(HEADER.size + nbytes)
    np.frombuffer(buf, dtype=np.uint8, offset=HEADER.size)[:] = np.frombuffer(row, dtype=np.uint8).reshape(-1)
    return buf


def seal(nskey: bytes, buf: bytearray, codec: Codec) -> Any:
    """The value of a :func:`staged` block: the header written in place when it is stored
    raw, else :func:`encode`."""
    raw = memoryview(buf)[HEADER.size:]
    if codec.compression != "none":
        return encode(nskey, raw, codec)
    buf[:HEADER.size] = pack_header(RAW, len(raw), len(raw), 0, checksum(nskey, raw), 0, 0)
    return memoryview(buf)


def decode_into(nskey: bytes, value: bytes, into: np.ndarray, codec: Codec) -> None:
    """Decode ``value`` into ``into`` (a contiguous uint8 row of the block's size) and
    verify it; raise :class:`CorruptRecord` when it is not this key's block. ``into`` is
    written even then: the caller must not use it after an error."""
    if len(value) < HEADER.size:
        raise CorruptRecord(f"value of {len(value)} bytes")
    hdr = Header.unpack(value[:HEADER.size])
    if hdr.raw_len != into.nbytes:
        raise CorruptRecord(f"a block of {hdr.raw_len} bytes, expected {into.nbytes}")
    if hdr.payload_len != len(value) - HEADER.size:
        raise CorruptRecord(f"payload of {len(value) - HEADER.size} bytes, header says {hdr.payload_len}")
    view = memoryview(into).cast("B")
    codec.decode(hdr.codec, memoryview(value)[HEADER.size:], hdr.raw_len, into=view)
    if checksum(nskey, view) != hdr.checksum:
        raise CorruptRecord("checksum mismatch")
