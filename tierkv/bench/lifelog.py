"""Block lifecycles of a replay, recorded as an event log and measured at the end.

:class:`LifecycleLog` has the recording interface of
:class:`tierkv.metrics.Lifecycle` (enter, access, leave) and the same
semantics, but appends each batch to flat lists in C (no per-key Python work)
and derives every sample at the end with numpy:

* a block's *life* in a tier runs from an enter to the first leave after it
  (another enter before that leave restarts it); accesses and leaves outside
  a life are ignored;
* lifetime = leave - enter; idle before evict = leave - the life's last
  enter or access; reuse gap = access - the life's previous enter or access.

Keys are the replay's 8-byte block keys (little-endian block ids); each batch
is kept as one joined bytes object.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LifecycleLog"]

_ENTER, _ACCESS, _LEAVE = 0, 1, 2


class LifecycleLog:
    """Enter/access/leave events of one tier; :meth:`samples` measures them."""

    __slots__ = ("_kinds", "_times", "_sizes", "_blobs")

    def __init__(self) -> None:  # one entry per batch in each list
        self._kinds: list[int] = []
        self._times: list[float] = []
        self._sizes: list[int] = []
        self._blobs: list[bytes] = []  # the batch's keys, joined

    def _log(self, kind: int, keys: Any, now: float) -> None:
        if keys:
            self._kinds.append(kind)
            self._times.append(now)
            self._sizes.append(len(keys))
            self._blobs.append(b"".join(keys))

    def enter_many(self, keys: Any, now: float) -> None:
        self._log(_ENTER, keys, now)

    def access_many(self, keys: Any, now: float) -> None:
        self._log(_ACCESS, keys, now)

    def leave_many(self, keys: Any, now: float) -> None:
        self._log(_LEAVE, keys, now)

    def access(self, key: bytes, now: float) -> None:
        self._log(_ACCESS, (key,), now)

    def samples(self) -> dict[str, Any]:
        """``lifetime_s``, ``idle_before_evict_s`` and ``reuse_gap_s`` (float arrays, grouped by
        block rather than in event order: their distributions are what matters)."""
        import numpy as np

        if not self._blobs:
            return {"lifetime_s": np.empty(0), "idle_before_evict_s": np.empty(0), "reuse_gap_s": np.empty(0)}
        sizes = np.asarray(self._sizes, dtype=np.int64)
        keys = np.frombuffer(b"".join(self._blobs), dtype="<u8")
        if len(keys) != sizes.sum():
            raise ValueError("LifecycleLog: keys must be 8 bytes long")
        times = np.repeat(np.asarray(self._times, dtype=np.float64), sizes)
        kinds = np.repeat(np.asarray(self._kinds, dtype=np.int8), sizes)
        order = _by_key_then_time(keys)
        keys, times, kinds = keys[order], times[order], kinds[order]
        alive = _alive(keys, kinds)
        prev_t = np.concatenate(([0.0], times[:-1]))  # in a life, the previous event is its enter or an access
        leave = alive & (kinds == _LEAVE)
        since_prev = times - prev_t
        life = (times - times[_last_enter(kinds)])[leave]
        idle = since_prev[leave]
        gaps = since_prev[alive & (kinds == _ACCESS)]
        return {"lifetime_s": life, "idle_before_evict_s": idle, "reuse_gap_s": gaps}


def _by_key_then_time(keys: Any) -> Any:
    """The permutation that sorts events by key, keeping their order within a key: one
    plain sort of ``key << b | index`` when both fit 63 bits (20x faster than a stable
    argsort), else a stable argsort."""
    import numpy as np

    n = len(keys)
    index_bits = max(1, int(n).bit_length())
    if int(keys.max()).bit_length() + index_bits <= 63:
        packed = np.sort((keys.astype(np.uint64) << np.uint64(index_bits)) | np.arange(n, dtype=np.uint64))
        return (packed & np.uint64((1 << index_bits) - 1)).astype(np.int64)
    return np.argsort(keys, kind="stable")


def _last_enter(kinds: Any) -> Any:
    """Index of the latest enter at or before each event (0 where none)."""
    import numpy as np

    idx = np.where(kinds == _ENTER, np.arange(len(kinds)), 0)
    return np.maximum.accumulate(idx)


def _alive(keys: Any, kinds: Any) -> Any:
    """Events (sorted by key, then time) that fall inside a life: after an enter of the same
    key, with no leave between that enter and the event (the first leave itself counts)."""
    import numpy as np

    n = len(kinds)
    idx = np.arange(n)
    key_start = np.maximum.accumulate(np.where(np.concatenate(([True], keys[1:] != keys[:-1])), idx, 0))
    last_enter = np.maximum.accumulate(np.where(kinds == _ENTER, idx, -1))
    entered = last_enter >= key_start
    leaves = np.cumsum(kinds == _LEAVE)
    leaves_at_enter = leaves[np.maximum(last_enter, 0)]  # an enter is never a leave: leaves up to it
    before = leaves - (kinds == _LEAVE) - leaves_at_enter  # leaves after the enter, before this event
    return entered & (before == 0) & (kinds != _ENTER)

