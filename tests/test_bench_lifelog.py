"""The replay's vectorised lifecycle log measures exactly what the online Lifecycle measures."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.bench.lifelog import LifecycleLog
from kvstrata.core.metrics import Lifecycle

EVENTS = st.lists(st.tuples(st.sampled_from(["enter", "access", "leave"]), st.integers(0, 4),
                            st.integers(0, 3)), max_size=80)


def key(i: int) -> bytes:
    return i.to_bytes(8, "little")


@settings(max_examples=400, deadline=None)
@given(EVENTS)
def test_log_matches_the_online_lifecycle(events) -> None:
    online, log = Lifecycle(keep_samples=True), LifecycleLog()
    now = 0.0
    for kind, k, dt in events:
        now += dt
        if kind == "enter":
            online.enter(key(k), now)
            log.enter_many([key(k)], now)
        elif kind == "access":
            online.access(key(k), now)
            log.access_many([key(k)], now)
        else:
            online.leave(key(k), now)
            log.leave_many([key(k)], now)
    got, want = log.samples(), online.samples()
    assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v or []) for k, v in want.items()}


def test_worked_example() -> None:
    log = LifecycleLog()
    a, b = key(1), key(2)
    log.enter_many([a, b], 0.0)
    log.access_many([a], 2.0)
    log.leave_many([a], 5.0)      # a: life 5, idle 3
    log.access_many([a], 6.0)     # after its life: ignored
    log.enter_many([a], 7.0)
    log.leave_many([b, a], 10.0)  # b: life 10, idle 10; a: life 3, idle 3
    s = {k: sorted(v) for k, v in log.samples().items()}
    assert s == {"lifetime_s": [3.0, 5.0, 10.0], "idle_before_evict_s": [3.0, 3.0, 10.0], "reuse_gap_s": [2.0]}


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["enter", "access", "leave"]), st.lists(st.integers(0, 5), min_size=1,
                                                                              max_size=3, unique=True),
                          st.integers(0, 3)), max_size=80), st.integers(1, 7))
def test_folding_as_it_goes_measures_what_one_fold_at_the_end_does(events, fold_events: int) -> None:
    """A log measured every few keys (carrying only its alive blocks from fold to fold) gives the
    online Lifecycle's samples, batches of several keys included."""
    online, log = Lifecycle(keep_samples=True), LifecycleLog(fold_events=fold_events)
    now = 0.0
    for kind, ks, dt in events:
        now += dt
        for k in ks:
            getattr(online, kind)(key(k), now)
        getattr(log, f"{kind}_many")([key(k) for k in ks], now)
    got, want = log.samples(), online.samples()
    assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v or []) for k, v in want.items()}


def test_memory_between_folds_is_the_alive_blocks_not_the_events() -> None:
    """A million events over 100 blocks: what stays is those blocks' state and the summaries."""
    log = LifecycleLog(fold_events=4096)
    keys = [key(i) for i in range(100)]
    now = 0.0
    for _ in range(3_400):
        now += 1.0
        log.enter_many(keys[:50], now)
        log.access_many(keys[25:], now + 0.5)
        log.leave_many(keys[10:40], now + 0.75)
        log.enter_many(keys[50:], now + 0.9)
        log.leave_many(keys[60:80], now + 0.95)
    log.fold()
    assert log._alive_keys.size <= 100
    assert log.retained_bytes() < 64 * 1024
    s = log.samples()
    assert s["lifetime_s"].count == 3_400 * 50 and s["reuse_gap_s"].count > 3_400 * 50
