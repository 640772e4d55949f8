"""The remote tier's keys and values.

Key: ``kvstrata:<namespace hex>:`` (:func:`key_prefix`), the generation and ``:``
(:mod:`.generation`: a reset moves a replica to a new one), then the block key (32
bytes, binary). The namespace is the SSD tier's (:func:`~kvstrata.tiers.ssd.record.namespace_of` of a
shard's tier id): two replicas of one checkpoint and layout share keys,
different checkpoints, layouts, TP ranks or record versions never do, and an
operator can list or delete kvstrata's keys by prefix. Values a deployment
signs and values it trusts unsigned (``remote.trust_server``) live under
different prefixes (``kvstrata:u:`` for the latter), so the two never read each
other's values.

Value: the SSD record header (:data:`~kvstrata.tiers.ssd.record.HEADER`, with no
tail and page 0) and the payload, encoded by the SSD tier's
:class:`~kvstrata.tiers.ssd.record.Codec`, sealed by an :class:`~.auth.Auth`: encrypted
and authenticated with AES-256-GCM by default, or only signed (``remote.encrypt:
false``); see :mod:`.auth` for the formats, the keys and the nonces. Either way, whoever
can write to the server but lacks the secret cannot make a value that verifies, under
any key; with encryption, whoever can only read it learns the keys (which prefixes are
cached), the sizes and the timing, not the KV (from which a public checkpoint's tokens
can be recovered).

The checksum in the header (xxh3 seeded with the whole key) still catches a damaged
value cheaply after decoding; it is no protection against a writer, who can compute it.

Anything that does not verify (a forgery, another tool's bytes, a truncated
value, another block size, a value longer than any this tier writes) is
:class:`~kvstrata.tiers.ssd.record.CorruptRecord`: a miss for the caller.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstrata.tiers.remote.auth import AUTH_SIZE, Auth
from kvstrata.tiers.ssd.record import HEADER, RAW, Codec, CorruptRecord, Header, checksum, namespace_of, pack_header

__all__ = ["PREFIX", "AUTH_SIZE", "Auth", "key_prefix", "encode", "staged", "seal", "decode_into", "value_bytes",
           "max_value_bytes"]

PREFIX = b"kvstrata:"
UNSIGNED = b"u:"   # the prefix's marker of values a deployment trusts unsigned


def key_prefix(tier_id: str, signed: bool = True) -> bytes:
    """The prefix of every key of one shard (a :meth:`Fingerprint.tier_id`), for signed values
    or for values trusted unsigned."""
    return PREFIX + (b"" if signed else UNSIGNED) + namespace_of(tier_id.encode()).hex().encode() + b":"


def _front(auth: Auth | None) -> int:
    """Where the payload starts in a staged buffer."""
    return HEADER.size + (auth.front if auth is not None else 0)


def value_bytes(block_nbytes: int, auth: Auth | None = None) -> int:
    """The value of a block stored raw: what a pipeline's bytes are counted in."""
    return _front(auth) + block_nbytes + (auth.tail if auth is not None else 0)


def max_value_bytes(block_nbytes: int, auth: Auth | None = None) -> int:
    """The longest value this tier can write for a block (zstd's worst case included): a
    longer one is not read."""
    return value_bytes(block_nbytes, auth) + block_nbytes // 128 + 1024


def encode(nskey: bytes, raw: Any, codec: Codec, auth: Auth | None = None) -> Any:
    """The value stored under ``nskey`` for the block ``raw`` (bytes-like)."""
    kind, payload = codec.encode(raw)
    head = pack_header(kind, len(raw), len(payload), 0, checksum(nskey, raw), 0, 0)
    if auth is None:
        return b"".join((head, payload))
    buf = bytearray(auth.front + len(head) + len(payload) + auth.tail)
    buf[auth.front:auth.front + len(head)] = head
    buf[auth.front + len(head):len(buf) - auth.tail] = payload
    return auth.wrap(nskey, buf)


def staged(row: Any, buf: bytearray | None = None, auth: Auth | None = None) -> bytearray:
    """A copy of ``row`` with room for the seal and header in front (into ``buf`` when it
    has the right size: a recycled buffer costs no page faults): what :func:`seal` turns
    into a value without copying the block again when it is only signed."""
    nbytes = int(getattr(row, "nbytes", len(row)))
    front = _front(auth)
    if buf is None or len(buf) != value_bytes(nbytes, auth):
        buf = bytearray(value_bytes(nbytes, auth))
    np.frombuffer(buf, dtype=np.uint8, offset=front, count=nbytes)[:] = np.frombuffer(row, dtype=np.uint8).reshape(-1)
    return buf


def seal(nskey: bytes, buf: bytearray, codec: Codec, auth: Auth | None = None) -> Any:
    """The value of a :func:`staged` block: the header (and signature) written in place when
    it is stored raw (encrypted into a new buffer when sealed), else :func:`encode`."""
    front, tail = _front(auth), (auth.tail if auth is not None else 0)
    raw = memoryview(buf)[front:len(buf) - tail]
    if codec.compression != "none":
        return encode(nskey, raw, codec, auth)
    buf[front - HEADER.size:front] = pack_header(RAW, len(raw), len(raw), 0, checksum(nskey, raw), 0, 0)
    return auth.wrap(nskey, buf) if auth is not None else memoryview(buf)


def decode_into(nskey: bytes, value: Any, into: np.ndarray, codec: Codec, auth: Auth | None = None) -> None:
    """Verify ``value`` and decode it into ``into`` (a contiguous uint8 row of the block's
    size); raise :class:`CorruptRecord` when it is not this key's block. ``into`` may be
    written even then: the caller must not use it after an error."""
    body = auth.open(nskey, value) if auth is not None else memoryview(value)
    if len(body) < HEADER.size:
        raise CorruptRecord(f"value of {len(body)} bytes")
    hdr = Header.unpack(body[:HEADER.size])
    if hdr.raw_len != into.nbytes:
        raise CorruptRecord(f"a block of {hdr.raw_len} bytes, expected {into.nbytes}")
    if hdr.payload_len != len(body) - HEADER.size:
        raise CorruptRecord(f"payload of {len(body) - HEADER.size} bytes, header says {hdr.payload_len}")
    view = memoryview(into).cast("B")
    codec.decode(hdr.codec, body[HEADER.size:], hdr.raw_len, into=view)
    if checksum(nskey, view) != hdr.checksum:
        raise CorruptRecord("checksum mismatch")
