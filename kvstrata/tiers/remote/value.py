"""The remote tier's keys and values.

Key: ``kvstrata:<namespace hex>:`` + the block key (32 bytes, binary). The
namespace is the SSD tier's (:func:`~kvstrata.tiers.ssd.record.namespace_of` of a
shard's tier id): two replicas of one checkpoint and layout share keys,
different checkpoints, layouts, TP ranks or record versions never do, and an
operator can list or delete kvstrata's keys by prefix. Values a deployment
signs and values it trusts unsigned (``remote.trust_server``) live under
different prefixes (``kvstrata:u:`` for the latter), so the two never read each
other's values.

Value: ``[key id (4) | MAC (16)]`` when signed, then the SSD record header
(:data:`~kvstrata.tiers.ssd.record.HEADER`, with no tail and page 0) and the
payload, encoded by the SSD tier's :class:`~kvstrata.tiers.ssd.record.Codec`.

* **The MAC** (:class:`Auth`) is an HMAC-SHA256 (truncated to 128 bits) under a
  key derived from the deployment's secret, over the whole key (namespace and
  block hash), the header and the payload (SHA-256 over HMAC: the CPU's SHA
  instructions make it the fastest cryptographic MAC at hand, about 1.5x
  keyed BLAKE2b on this machine): whoever can write to the server but lacks the secret cannot make a
  value that verifies, under any key. The key id names which secret signed it,
  so a fleet can rotate: readers accept every configured secret, writers sign
  with the first.
* **The checksum** in the header (xxh3 seeded with the whole key) still catches
  a damaged value cheaply after decoding; it is no protection against a writer,
  who can compute it.

Anything that does not verify (a forgery, another tool's bytes, a truncated
value, another block size, a value longer than any this tier writes) is
:class:`~kvstrata.tiers.ssd.record.CorruptRecord`: a miss for the caller.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Sequence

import numpy as np

from kvstrata.tiers.ssd.record import HEADER, RAW, Codec, CorruptRecord, Header, checksum, namespace_of, pack_header

__all__ = ["PREFIX", "AUTH_SIZE", "Auth", "key_prefix", "encode", "staged", "seal", "decode_into", "value_bytes",
           "max_value_bytes"]

PREFIX = b"kvstrata:"
UNSIGNED = b"u:"   # the prefix's marker of values a deployment trusts unsigned
_ID, _MAC = 4, 16
AUTH_SIZE = _ID + _MAC


class Auth:
    """MACs of remote values under a deployment's ``secrets`` (at least one; the first signs,
    every one verifies)."""

    def __init__(self, secrets: Sequence[bytes]) -> None:
        if not secrets:
            raise ValueError("secrets: expected at least one")
        keys = [(_derive(s, b"kvstrata-key-id", _ID), _derive(s, b"kvstrata-mac-key", 64)) for s in secrets]
        self.write_id, self._write_key = keys[0]
        self._keys = dict(reversed(keys))  # a repeated id: the first secret's key

    def __repr__(self) -> str:  # never the keys
        return f"Auth(signing with key id {self.write_id.hex()}, {len(self._keys)} accepted)"

    def tag(self, nskey: bytes, *body: Any) -> bytes:
        """The key id and MAC that sign ``body`` (the header and the payload) under ``nskey``."""
        return self.write_id + _mac(self._write_key, nskey, body)

    def verify(self, nskey: bytes, value: Any) -> memoryview:
        """``value`` without its signature, if the signature is a valid one of ``nskey``'s
        value under an accepted secret; else :class:`CorruptRecord`."""
        view = memoryview(value)
        if len(view) < AUTH_SIZE:
            raise CorruptRecord(f"value of {len(view)} bytes")
        key = self._keys.get(bytes(view[:_ID]))
        if key is None:
            raise CorruptRecord("signed by an unknown key (another deployment's secret, or unsigned)")
        if not hmac.compare_digest(_mac(key, nskey, (view[AUTH_SIZE:],)), bytes(view[_ID:AUTH_SIZE])):
            raise CorruptRecord("its MAC does not verify")
        return view[AUTH_SIZE:]


def _derive(secret: bytes, person: bytes, size: int) -> bytes:
    return hashlib.blake2b(secret, digest_size=size, person=person).digest()


def _mac(key: bytes, nskey: bytes, body: Sequence[Any]) -> bytes:
    h = hmac.new(key, len(nskey).to_bytes(2, "big") + nskey, "sha256")
    for part in body:
        h.update(part)
    return h.digest()[:_MAC]


def key_prefix(tier_id: str, signed: bool = True) -> bytes:
    """The prefix of every key of one shard (a :meth:`Fingerprint.tier_id`), for signed values
    or for values trusted unsigned."""
    return PREFIX + (b"" if signed else UNSIGNED) + namespace_of(tier_id.encode()).hex().encode() + b":"


def _front(auth: Auth | None) -> int:
    return HEADER.size + (AUTH_SIZE if auth is not None else 0)


def value_bytes(block_nbytes: int, auth: Auth | None = None) -> int:
    """The value of a block stored raw: what a pipeline's bytes are counted in."""
    return _front(auth) + block_nbytes


def max_value_bytes(block_nbytes: int, auth: Auth | None = None) -> int:
    """The longest value this tier can write for a block (zstd's worst case included): a
    longer one is not read."""
    return value_bytes(block_nbytes, auth) + block_nbytes // 128 + 1024


def encode(nskey: bytes, raw: Any, codec: Codec, auth: Auth | None = None) -> bytes:
    """The value stored under ``nskey`` for the block ``raw`` (bytes-like)."""
    kind, payload = codec.encode(raw)
    head = pack_header(kind, len(raw), len(payload), 0, checksum(nskey, raw), 0, 0)
    if auth is None:
        return b"".join((head, payload))
    return b"".join((auth.tag(nskey, head, payload), head, payload))


def staged(row: Any, buf: bytearray | None = None, auth: Auth | None = None) -> bytearray:
    """A copy of ``row`` with room for the signature and header in front (into ``buf`` when
    it has the right size: a recycled buffer costs no page faults): what :func:`seal` turns
    into a value without copying the block again."""
    nbytes = int(getattr(row, "nbytes", len(row)))
    front = _front(auth)
    if buf is None or len(buf) != front + nbytes:
        buf = bytearray(front + nbytes)
    np.frombuffer(buf, dtype=np.uint8, offset=front)[:] = np.frombuffer(row, dtype=np.uint8).reshape(-1)
    return buf


def seal(nskey: bytes, buf: bytearray, codec: Codec, auth: Auth | None = None) -> Any:
    """The value of a :func:`staged` block: the header (and signature) written in place when
    it is stored raw, else :func:`encode`."""
    front = _front(auth)
    raw = memoryview(buf)[front:]
    if codec.compression != "none":
        return encode(nskey, raw, codec, auth)
    start = front - HEADER.size
    buf[start:front] = pack_header(RAW, len(raw), len(raw), 0, checksum(nskey, raw), 0, 0)
    if auth is not None:
        buf[:start] = auth.tag(nskey, memoryview(buf)[start:])
    return memoryview(buf)


def decode_into(nskey: bytes, value: Any, into: np.ndarray, codec: Codec, auth: Auth | None = None) -> None:
    """Verify ``value`` and decode it into ``into`` (a contiguous uint8 row of the block's
    size); raise :class:`CorruptRecord` when it is not this key's block. ``into`` may be
    written even then: the caller must not use it after an error."""
    body = auth.verify(nskey, value) if auth is not None else memoryview(value)
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
