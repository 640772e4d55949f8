"""Block hash chains.

``h[-1] = H(domain || namespace)`` and ``h[i] = H(h[i-1] || tokens of block i ||
extra keys of block i)``, one digest per FULL block.  Because every digest folds
in its parent, a block's hash identifies the whole prefix up to and including
it, and the namespace (a model/KV-layout fingerprint) enters every hash.

Serialisation is fixed and platform independent: token ids are little-endian
uint32, extra keys are tagged and length-prefixed, so the result never depends
on ``PYTHONHASHSEED``, the process, or the machine's byte order.

Extra keys: ``cache_salt`` enters the first block only (the chain carries it on),
``lora_id`` enters every block, a multimodal hash enters every block that its
placeholder range overlaps.
"""

from __future__ import annotations

import array
import hashlib
import logging
import struct
import sys
from typing import Any, Callable, Sequence, Union

from kvstrata.errors import ConfigError

__all__ = ["BlockHasher", "MMHash", "ALGORITHMS"]

log = logging.getLogger(__name__)

ALGORITHMS = ("sha256", "sha256_cbor", "xxh3_128")

# (identifier, first token offset, number of tokens) of one multimodal placeholder.
MMHash = tuple[Union[str, bytes], int, int]

_DOMAIN = b"kvstrata.block-hash.v1\x00"
_TAG_SALT, _TAG_LORA, _TAG_MM = b"\x01", b"\x02", b"\x03"
_warned_xxh3 = False
_BIG_ENDIAN = sys.byteorder == "big"


def _as_bytes(value: str | bytes | int, what: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value).encode("ascii")
    raise ValueError(f"{what}: expected str, bytes or int, got {type(value).__name__}")


def _tagged(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack("<I", len(payload)) + payload


def _hash_ctor(algo: str) -> Callable[[bytes], Any]:
    """The hash object constructor of ``algo`` (called as ``ctor(data).digest()``)."""
    if algo == "sha256" or algo == "sha256_cbor":
        return hashlib.sha256
    if algo == "xxh3_128":
        import xxhash

        global _warned_xxh3
        if not _warned_xxh3:
            log.warning("hash=xxh3_128 is fast but not collision-resistant against crafted input; "
                        "use it only for trusted, single-tenant traffic")
            _warned_xxh3 = True
        return xxhash.xxh3_128
    raise ConfigError(f"hash: unknown algorithm {algo!r}; expected one of {', '.join(ALGORITHMS)}")


class BlockHasher:
    """Chained per-block digests of a token sequence.

    ``namespace`` must identify everything that makes KV bytes incompatible
    (model, dtype, KV layout, block size, ...): blocks hashed under different
    namespaces never collide.
    """

    __slots__ = ("block_size", "algo", "namespace", "root", "digest_size", "_new", "_cbor")

    def __init__(self, block_size: int, algo: str = "sha256", namespace: bytes | str = b"") -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: expected a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.algo = algo
        self._new = _hash_ctor(algo)
        self._cbor = None
        if algo == "sha256_cbor":
            import cbor2

            self._cbor = cbor2.dumps
        self.namespace = _as_bytes(namespace, "namespace")
        self.root = self._new(_DOMAIN + algo.encode() + b"\x00" + self.namespace).digest()
        self.digest_size = len(self.root)

    # ------------------------------------------------------------------ public

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | bytes | None = None,
        lora_id: str | bytes | int | None = None,
        mm_hashes: Sequence[MMHash] | None = None,
    ) -> list[bytes]:
        """One digest per full block of ``token_ids`` (a trailing partial block is not hashed)."""
        return self.extend([], token_ids, cache_salt=cache_salt, lora_id=lora_id, mm_hashes=mm_hashes)

    def check_tokens(self, token_ids: Sequence[int]) -> None:
        """Raise ``ValueError`` naming the first token that is not an integer in
        ``[0, 2**32)`` (what a block hash can take), also in a block not yet full."""
        self._pack(token_ids, 0, len(token_ids))

    def extend(
        self,
        hashes: list[bytes],
        token_ids: Sequence[int],
        *,
        cache_salt: str | bytes | None = None,
        lora_id: str | bytes | int | None = None,
        mm_hashes: Sequence[MMHash] | None = None,
    ) -> list[bytes]:
        """Continue a chain: ``hashes`` are the digests of the first ``len(hashes)``
        blocks of ``token_ids``; append those of the remaining full blocks (in place)
        and return the list."""
        bs = self.block_size
        start = len(hashes)
        end = len(token_ids) // bs
        if end <= start:
            return hashes
        lora = _tagged(_TAG_LORA, _as_bytes(lora_id, "lora_id")) if lora_id is not None else b""
        salt = _tagged(_TAG_SALT, _as_bytes(cache_salt, "cache_salt")) if cache_salt is not None else b""
        parent = hashes[-1] if hashes else self.root
        if self._cbor is not None:
            return self._extend_cbor(hashes, token_ids, start, end, parent, salt, lora, mm_hashes)
        packed = self._pack(token_ids, start * bs, end * bs)
        new = self._new
        nbytes = bs * 4
        append = hashes.append
        if start == 0 and salt:  # the salt enters the first block only
            parent = new(parent + packed[:nbytes] + salt + lora + self._mm_extra(mm_hashes, 0)).digest()
            append(parent)
            start, packed = 1, packed[nbytes:]
        if mm_hashes:
            for i in range(start, end):
                off = (i - start) * nbytes
                parent = new(parent + packed[off:off + nbytes] + lora + self._mm_extra(mm_hashes, i)).digest()
                append(parent)
        elif lora:
            for off in range(0, (end - start) * nbytes, nbytes):
                parent = new(parent + packed[off:off + nbytes] + lora).digest()
                append(parent)
        else:  # the hot path: parent || tokens, nothing else
            for off in range(0, (end - start) * nbytes, nbytes):
                parent = new(parent + packed[off:off + nbytes]).digest()
                append(parent)
        return hashes

    def block_extra(self, index: int, *, cache_salt: str | bytes | None = None,
                    lora_id: str | bytes | int | None = None, mm_hashes: Sequence[MMHash] | None = None) -> bytes:
        """What block ``index`` of a request hashes beside its parent and tokens (the salt on
        the first block, the LoRA, the media overlapping it): with :meth:`block_key`, enough
        to check a block's key from what is kept beside it."""
        salt = _tagged(_TAG_SALT, _as_bytes(cache_salt, "cache_salt")) if cache_salt is not None and index == 0 \
            else b""
        lora = _tagged(_TAG_LORA, _as_bytes(lora_id, "lora_id")) if lora_id is not None else b""
        return salt + lora + self._mm_extra(mm_hashes, index)

    def block_key(self, parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
        """The key of one full block: ``parent``'s (None: the first block of a chain), its
        ``block_size`` tokens and its :meth:`block_extra`, as :meth:`extend` computes it."""
        if len(token_ids) != self.block_size:
            raise ValueError(f"token_ids: expected {self.block_size} tokens, got {len(token_ids)}")
        parent = self.root if parent is None else parent
        if self._cbor is not None:
            return self._new(self._cbor([parent, [int(t) for t in token_ids], extra])).digest()
        return self._new(parent + self._pack(token_ids, 0, len(token_ids)) + extra).digest()

    # ---------------------------------------------------------------- internals

    @staticmethod
    def _pack(token_ids: Sequence[int], lo: int, hi: int) -> bytes:
        try:
            arr = array.array("I", token_ids[lo:hi])  # C unsigned int: 4 bytes on every supported platform
        except (OverflowError, TypeError):
            arr = None
        if arr is not None and arr.itemsize == 4:
            if _BIG_ENDIAN:
                arr.byteswap()
            return arr.tobytes()
        try:
            return struct.pack(f"<{hi - lo}I", *token_ids[lo:hi])
        except struct.error:
            bad = next((t for t in token_ids[lo:hi] if not isinstance(t, int) or not 0 <= t < 2**32), None)
            raise ValueError(f"token_ids: expected integers in [0, 2**32), got {bad!r}") from None

    def _mm_extra(self, mm_hashes: Sequence[MMHash] | None, block_index: int) -> bytes:
        if not mm_hashes:
            return b""
        lo, hi = block_index * self.block_size, (block_index + 1) * self.block_size
        out = b""
        for ident, offset, length in mm_hashes:
            if offset < hi and offset + length > lo:
                out += _tagged(_TAG_MM, _as_bytes(ident, "mm_hashes") + struct.pack("<q", offset))
        return out

    def _extend_cbor(self, hashes, token_ids, start, end, parent, salt, lora, mm_hashes):  # type: ignore[no-untyped-def]
        bs = self.block_size
        for i in range(start, end):
            extra = (salt if i == 0 else b"") + lora
            if mm_hashes:
                extra += self._mm_extra(mm_hashes, i)
            block = [int(t) for t in token_ids[i * bs:(i + 1) * bs]]
            parent = self._new(self._cbor([parent, block, extra])).digest()
            hashes.append(parent)
        return hashes
