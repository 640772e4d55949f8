"""A bounded memory of keys seen once: what ``second_hit`` admission asks before a tier takes a block.

:class:`Ghost` remembers the last ``capacity`` keys it was shown (first in, first
out) by an 8-byte fingerprint (the key's first 8 bytes: keys are cryptographic or
128-bit hashes, so fingerprints of distinct blocks collide with probability
~n^2/2^65, and a collision only admits a block one sighting early). It holds
no bytes of a block: ~16 to 24 bytes per key (a ring of slots and a hash table
at most half full, :class:`~kvstrata.policy.flat_keys.FlatKeys`).

Threading: owned by the policy's owner thread, like the policy.
"""

from __future__ import annotations

from kvstrata.errors import ConfigError
from kvstrata.policy.flat_keys import NIL, FlatKeys

__all__ = ["Ghost", "FINGERPRINT_BYTES"]

FINGERPRINT_BYTES = 8


class Ghost:
    """The last ``capacity`` keys seen once."""

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"ghost_keys: expected a positive integer, got {capacity!r}")
        self.capacity = capacity
        self._keys = FlatKeys()
        self._next = 0     # the ring's slot the next new key takes
        self._used = 0     # slots handed out so far (the ring fills once, then recycles)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: bytes) -> bool:
        return self._keys.find(key[:FINGERPRINT_BYTES]) != NIL

    def seen(self, key: bytes) -> bool:
        """Was ``key`` seen before (within the window)? If so it is forgotten (the tier takes it
        now); if not it is remembered, pushing out the oldest key when the window is full."""
        fp = key[:FINGERPRINT_BYTES]
        keys = self._keys
        slot = keys.find(fp)
        if slot != NIL:
            keys.delete(fp, slot)
            return True
        slot = self._next
        if slot < self._used:  # the ring came round: the oldest key leaves (unless it was taken already)
            old = keys.key_of(slot)
            if keys.find(old) == slot:
                keys.delete(old, slot)
        else:
            self._used += 1
        keys.insert(fp, slot, self._used)
        self._next = (slot + 1) % self.capacity
        return False

    def nbytes(self) -> int:
        return self._keys.nbytes()
