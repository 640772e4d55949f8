"""The remote tier's keys: what a deployment's secret becomes, and how a value is sealed.

**Derivation** (:func:`derive`, once per secret when the tier starts): scrypt of the
secret (N=2^15, r=8, p=1: about 0.1 s and 32 MiB on these machines) gives a 32-byte
master key; HMAC-SHA256 of the master under distinct labels gives the AEAD key, the MAC
key and the key id. The key id (4 bytes, on every value, public) is a function of the
master only, so testing a guessed secret against a value costs a full scrypt run, whether
by its key id, its MAC or its ciphertext. The salt is fixed and public (:data:`SALT`):
every replica of a fleet must derive the same keys from the secret alone. A public salt
lets one dictionary run serve against every kvstrata deployment, which is why a secret
must also resist guessing on its own (:func:`kvstrata.config.credentials.secret_bits`;
``kvstrata remote secret`` makes one of 256 random bits).

**Formats** (the first byte is the version; a reader accepts both, a writer writes one):

* ``SEALED`` (2, the default): ``[2 | key id (4) | check (16) | nonce (12) |
  AES-256-GCM(header + payload) | tag (16)]``; the associated data is the whole key
  (namespace and block hash, length-prefixed) and the first :data:`AUTH_SIZE` bytes. A
  reader of the server sees sizes and keys, not the KV: the rows it could invert to the
  prompt's tokens (layer 0's K is ``k_proj(norm(embed[token]))`` rotated by position, and
  the checkpoint is public) are ciphertext.
* ``SIGNED`` (1, ``remote.encrypt: false``): ``[1 | key id (4) | MAC (16) | header |
  payload]``, the MAC an HMAC-SHA256 (truncated to 128 bits) over the version, the key
  id, the whole key, the header and the payload. Authentic, not private.

Values written before the version byte existed (a 4-byte key id hashed from the bare
secret, then a MAC) verify under neither format: a miss, deleted by the reader.

**Nonces**: 96 random bits per value (``os.urandom``). Under one key the chance that two
of n values share one is about n^2 / 2^97: below 2^-32 for 2^32 values (8 PiB of 2 MiB
blocks); a rotation (a new secret on the first line) starts a new key. A nonce derived
from the block was rejected: one block's KV differs bit-wise between replicas (batching
changes the floating-point sums), and a GCM nonce used for two plaintexts gives away
their XOR and the key that authenticates every value.

**check** (sealed values): HMAC-SHA256 under the MAC key of the version, key id, whole
key and the plaintext header (which carries the block's xxh3 checksum), truncated to 128
bits. The same block sealed twice has the same check, so a writer recognises its own
value when ``SET NX`` finds the key taken (:func:`~.writer.replace_squatters` compares the
first :data:`AUTH_SIZE` bytes), and nobody without the key can imitate it. It tells a
reader only whether two values hold the same block, which their keys already say.

Threads: an :class:`Auth` is immutable once built. Each seal and open makes its own
AESGCM object (microseconds), so the writer and reader threads share no cipher state;
opened plaintext goes to a per-thread scratch buffer, valid until that thread's next
:meth:`Auth.open`. ``cryptography`` is imported on the first seal or open.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from kvstrata.tiers.ssd.record import HEADER, CorruptRecord

__all__ = ["SIGNED", "SEALED", "AUTH_SIZE", "NONCE", "TAG", "SALT", "SCRYPT", "Keys", "derive", "check_cipher", "Auth"]

SIGNED, SEALED = 1, 2
_ID, _MAC = 4, 16
AUTH_SIZE = 1 + _ID + _MAC  # version, key id, MAC or check: what names a writer's value of a block
NONCE, TAG = 12, 16
SALT = b"kvstrata remote tier keys v2"
SCRYPT = {"n": 2**15, "r": 8, "p": 1}
_SCRYPT_MAXMEM = 64 * 1024**2


@dataclass(frozen=True)
class Keys:
    """What one secret derives to (:func:`derive`)."""

    key_id: bytes
    aead: bytes = field(repr=False)
    mac: bytes = field(repr=False)


_derived: dict[bytes, Keys] = {}
_derived_lock = threading.Lock()


def derive(secret: bytes) -> Keys:
    """The keys of ``secret``: one scrypt run (kept for this process: tests and a scheduler
    beside its workers derive each secret once)."""
    with _derived_lock:
        found = _derived.get(secret)
    if found is not None:
        return found
    master = hashlib.scrypt(secret, salt=SALT, maxmem=_SCRYPT_MAXMEM, dklen=32, **SCRYPT)
    keys = Keys(_sub(master, b"key id")[:_ID], _sub(master, b"aead key"), _sub(master, b"mac key"))
    with _derived_lock:
        _derived[secret] = keys
    return keys


def _sub(master: bytes, label: bytes) -> bytes:
    return hmac.new(master, b"kvstrata remote " + label, "sha256").digest()


def _aesgcm(key: bytes) -> Any:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(key)


def check_cipher() -> None:
    """A ConfigError at start, not a miss per value, when ``cryptography`` is missing or
    older than 47 (``encrypt_into`` and ``decrypt_into``)."""
    from kvstrata.errors import ConfigError

    need = "the remote tier encrypts its values with the cryptography package (47 or later): " \
           "pip install 'kvstrata[remote]'"
    try:
        cipher = _aesgcm(bytes(32))
    except ImportError:
        raise ConfigError(f"remote.url: {need}") from None
    if not (hasattr(cipher, "encrypt_into") and hasattr(cipher, "decrypt_into")):
        import cryptography

        raise ConfigError(f"remote.url: {need}; found {cryptography.__version__}")


_scratch = threading.local()


def _scratch_view(n: int) -> memoryview:
    buf = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < n:
        buf = _scratch.buf = bytearray(n)
    return memoryview(buf)[:n]


class Auth:
    """Seals and opens remote values under a deployment's ``secrets`` (at least one; the
    first seals, every one opens). ``encrypt``: write :data:`SEALED` values (else
    :data:`SIGNED`)."""

    def __init__(self, secrets: Sequence[bytes], encrypt: bool = True) -> None:
        if not secrets:
            raise ValueError("secrets: expected at least one")
        check_cipher()
        keys = [derive(s) for s in secrets]
        self.encrypt = encrypt
        self.version = SEALED if encrypt else SIGNED
        self._write = keys[0]
        self.write_id = keys[0].key_id
        self._keys = {k.key_id: k for k in reversed(keys)}  # a repeated id: the first secret's keys
        self.front = AUTH_SIZE + (NONCE if encrypt else 0)  # bytes before the header
        self.tail = TAG if encrypt else 0                   # bytes after the payload

    def __repr__(self) -> str:  # never the keys
        mode = "sealing" if self.encrypt else "signing"
        return f"Auth({mode} with key id {self.write_id.hex()}, {len(self._keys)} accepted)"

    def wrap(self, nskey: bytes, buf: bytearray) -> Any:
        """The value of ``buf`` (``front`` free bytes, the header and payload, ``tail`` free
        bytes) under ``nskey``: ``buf`` itself, signed in place, or a new sealed buffer."""
        view = memoryview(buf)
        plain = view[self.front:len(buf) - self.tail]
        if not self.encrypt:
            buf[:AUTH_SIZE] = self._named(SIGNED, self._write, nskey, plain)
            return view
        nonce = os.urandom(NONCE)
        named = self._named(SEALED, self._write, nskey, plain[:HEADER.size])
        out = bytearray(len(buf))
        out[:self.front] = named + nonce
        _aesgcm(self._write.aead).encrypt_into(nonce, plain, _aad(nskey, named), memoryview(out)[self.front:])
        return out

    def open(self, nskey: bytes, value: Any) -> memoryview:
        """The header and payload of ``value`` if it verifies as ``nskey``'s value under an
        accepted secret (a sealed one decrypted into this thread's scratch buffer); else
        :class:`CorruptRecord`."""
        view = memoryview(value).cast("B")
        if len(view) < AUTH_SIZE:
            raise CorruptRecord(f"value of {len(view)} bytes")
        keys = self._keys.get(bytes(view[1:1 + _ID]))
        if keys is None or view[0] not in (SIGNED, SEALED):
            raise CorruptRecord("not sealed or signed under an accepted secret (another deployment's, or an "
                                "older format)")
        if view[0] == SIGNED:
            if not hmac.compare_digest(self._named(SIGNED, keys, nskey, view[AUTH_SIZE:]), bytes(view[:AUTH_SIZE])):
                raise CorruptRecord("its MAC does not verify")
            return view[AUTH_SIZE:]
        front = AUTH_SIZE + NONCE
        if len(view) < front + TAG:
            raise CorruptRecord(f"sealed value of {len(view)} bytes")
        out = _scratch_view(len(view) - front - TAG)
        try:
            _aesgcm(keys.aead).decrypt_into(bytes(view[AUTH_SIZE:front]), view[front:],
                                            _aad(nskey, bytes(view[:AUTH_SIZE])), out)
        except Exception as exc:  # InvalidTag: tampered, another key's, or truncated
            raise CorruptRecord(f"it does not decrypt ({type(exc).__name__})") from None
        return out

    @staticmethod
    def _named(version: int, keys: Keys, nskey: bytes, body: Any) -> bytes:
        """The version, key id and MAC of ``body`` (SIGNED: header and payload; SEALED: the
        header alone, the check)."""
        head = bytes((version,)) + keys.key_id
        h = hmac.new(keys.mac, head + len(nskey).to_bytes(2, "big") + nskey, "sha256")
        h.update(body)
        return head + h.digest()[:_MAC]


def _aad(nskey: bytes, named: bytes) -> bytes:
    return len(nskey).to_bytes(2, "big") + nskey + named
