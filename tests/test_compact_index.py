"""CompactIndex against SlotIndex: the same calls give the same answers, in the same
order, and the compact one costs what its docstring says per key."""

from __future__ import annotations

import hashlib
import tracemalloc

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstrata.policy.compact_index import CompactIndex
from kvstrata.policy.slot_index import PinnedError, SlotIndex


def key(i: int) -> bytes:
    return hashlib.sha256(b"%d" % i).digest()


KEYS = st.integers(0, 30).map(key)


class Differential(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ref = SlotIndex(8)
        self.got = CompactIndex(8)
        self.tombs = 0

    def both(self, name: str, *args, **kwargs):
        outs = []
        for index in (self.ref, self.got):
            try:
                outs.append(("ok", getattr(index, name)(*args, **kwargs)))
            except (PinnedError, KeyError, RuntimeError, ValueError) as exc:
                outs.append(("raised", type(exc)))
        assert outs[0] == outs[1], (name, args, outs)
        return outs[0]

    @rule(keys=st.lists(KEYS, max_size=6), pin=st.booleans())
    def allocate_many(self, keys, pin):
        self.both("allocate_many", keys, pin=pin)

    @rule(keys=st.lists(KEYS, max_size=6, unique=True), pin=st.booleans())
    def allocate_absent(self, keys, pin):
        keys = [k for k in keys if k not in self.ref]
        self.both("allocate_absent", keys, pin=pin)

    @rule(k=KEYS)
    def try_allocate(self, k):
        self.both("try_allocate", k)

    @rule(k=KEYS)
    def pop(self, k):
        self.both("pop", k)

    @rule(k=KEYS)
    def pin(self, k):
        self.both("pin", k)

    @rule(k=KEYS)
    def unpin(self, k):
        self.both("unpin", k)

    @rule(keys=st.lists(KEYS, max_size=6))
    def touch_many(self, keys):
        self.both("touch_many", keys)

    @precondition(lambda self: self.ref.num_pinned > 0)
    @rule(data=st.data())
    def bury(self, data):
        """What the policy does to a pinned key it forgets: rename it to a tombstone."""
        k = data.draw(st.sampled_from(sorted(self.ref._pins)))
        self.tombs += 1
        self.both("rename", k, b"\x00tomb:%d" % self.tombs)

    @invariant()
    def same(self):
        assert list(self.ref) == list(self.got)
        assert self.ref.lru_keys(3) == self.got.lru_keys(3)
        assert (len(self.ref), self.ref.num_free, self.ref.num_pinned) == \
            (len(self.got), self.got.num_free, self.got.num_pinned)
        for i in range(31):
            assert self.ref.lookup(key(i)) == self.got.lookup(key(i))
        self.ref.check()
        self.got.check()


TestDifferential = Differential.TestCase
TestDifferential.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)


def test_memory_per_key_follows_occupancy() -> None:
    """1M slots of which 200k are used: the arrays cost ~45 bytes per held 32-byte key,
    and nothing is allocated per key besides them."""
    n = 200_000
    keys = [key(i) for i in range(n)]
    tracemalloc.start()
    index = CompactIndex(1_000_000)
    base = tracemalloc.get_traced_memory()[0]
    for lo in range(0, n, 10_000):
        index.allocate_absent(keys[lo:lo + 10_000])
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    per_key = used / n
    assert len(index) == n and all(k in index for k in keys[::997])
    assert per_key < 64, f"{per_key:.1f} bytes per key"
    assert index.nbytes() / n < 64
    assert SlotIndex(1).num_slots == 1  # (the reference type stays importable beside it)


@pytest.mark.parametrize("n", [1, 7, 100])
def test_eviction_order_is_least_recently_used_first(n: int) -> None:
    index = CompactIndex(n)
    keys = [key(i) for i in range(2 * n)]
    index.allocate_absent(keys[:n])
    index.touch_many(keys[:1])  # the oldest becomes the newest
    _, evicted = index.allocate_absent(keys[n:])
    expected = keys[1:n] + keys[:1] if n > 1 else keys[:1]
    assert [k for k, _ in evicted] == expected
