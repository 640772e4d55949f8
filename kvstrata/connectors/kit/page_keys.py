"""An engine's page keys as kvstrata block keys: SHA-256 hex strings in, 32-byte keys out.

Engines that name their KV pages themselves (SGLang's HiCache keys each page by a SHA-256
chain over its tokens, seeded by the request's ``extra_key`` and ``cache_salt``) hand the
tiers hex strings. A page key becomes the block key
``SHA-256(domain || SHA-256(namespace) || pool || page digest)``: 32 bytes, rooted in the
deployment's namespace (:meth:`~kvstrata.identity.fingerprint.Fingerprint.namespace`, which
names the model, the page's bytes and the engine), so equal page keys of two deployments
never meet, and apart per pool (a hybrid model's KV and state pages share the page key).

A string that is not 64 hex digits is refused (None): the caller counts it as a miss or a
failed write, and nothing stored is touched for it. Engine-neutral: nothing here knows an
engine's objects.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Sequence

__all__ = ["PageKeys", "is_page_key", "leading"]

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_DOMAIN = b"kvstrata.page-key.v1\x00"


def is_page_key(key: Any) -> bool:
    """Whether ``key`` is a page key kvstrata takes: a string of exactly 64 hex digits."""
    return isinstance(key, str) and _HEX64.fullmatch(key) is not None


def leading(keys: Sequence[bytes | None]) -> int:
    """How many of ``keys``, from the first, were taken (the first refused one ends the run)."""
    return next((i for i, k in enumerate(keys) if k is None), len(keys))


class PageKeys:
    """Page keys under one deployment's ``namespace`` (bytes): :meth:`map` turns hex strings
    into block keys, None for each it refuses (:func:`is_page_key`), counted in
    :attr:`refused`. Safe from any thread (the count is a plain integer, incremented once
    per call)."""

    def __init__(self, namespace: bytes) -> None:
        if not isinstance(namespace, bytes) or not namespace:
            raise ValueError("namespace: expected non-empty bytes")
        self._root = _DOMAIN + hashlib.sha256(namespace).digest()
        self.refused = 0

    def key(self, page_key: Any, pool: str = "") -> bytes | None:
        """The block key of one page key in ``pool`` ("" for the KV pages), or None."""
        if not is_page_key(page_key):
            return None
        tag = pool.encode() + b"\x00"
        return hashlib.sha256(self._root + tag + bytes.fromhex(page_key)).digest()

    def map(self, page_keys: Sequence[Any], pool: str = "") -> list[bytes | None]:
        """:meth:`key` of each page key; the refused ones are counted."""
        out = [self.key(k, pool) for k in page_keys]
        bad = sum(k is None for k in out)
        if bad:
            self.refused += bad
        return out
